"""The public face: each public module's ``__all__`` as released, every name in it resolving, and
public modules that are modules of their own (no ``sys.modules`` swap onto an internal path)."""
import importlib

import pytest

PUBLIC = {
    "ampkit": [
        "__version__", "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "loss_scalers",
        "step_was_skipped", "nonfinite_gradients", "autocast", "disable_casts", "half_function", "float_function",
        "promote_function", "register_half_function", "register_float_function", "register_promote_function",
        "enable_console_logging", "NoEffectWarning", "OPT_LEVELS", "Properties", "LossScaler", "capabilities",
        "Capabilities", "checkpoint", "normalization", "parallel", "surgery", "fp16_utils", "float8", "footprint",
        "stochastic_rounding", "precision_report", "PrecisionReport",
    ],
    "ampkit.checkpoint": ["CheckpointError", "save", "load"],
    "ampkit.fp16_utils": [
        "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
        "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm", "convert_module",
        "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler", "DynamicLossScaler",
    ],
    "ampkit.footprint": ["persistent_bytes", "bytes_per_param"],
    "ampkit.float8": ["EXTRA", "available", "require", "check_exclude", "eligible", "has_fp8_matmul", "convert_"],
    "ampkit.surgery": ["replace_module_classes"],
    "ampkit.errors": ["NoEffectWarning"],
    "ampkit.stochastic_rounding": ["round_to_bf16_", "round_all_to_bf16_", "StochasticRounder", "manual_seed"],
    "ampkit.normalization": [
        "LPLayerNorm", "apply_low_precision_layernorm", "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm",
        "MixedFusedRMSNorm", "convert_batchnorm", "enable_mixed_input_batchnorm",
    ],
    "ampkit.parallel": [
        "DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group",
        "full_state_dict", "load_sharded", "save_sharded",
    ],
    "ampkit.integrations.lightning": ["AmpkitPrecision", "PrecisionReportCallback"],
    "ampkit.integrations.accelerate": ["AmpkitAccelerator", "attach"],
    "ampkit.integrations.transformers": ["AmpkitTrainer", "STATE_NAME"],
    "ampkit.integrations.stateful": ["AmpkitState"],
    "ampkit.integrations.schedulers": ["hold_on_skipped_steps"],
    "ampkit.apex_compat": ["install", "uninstall", "installed", "ApexInstalledError", "ENV"],
}
NEEDS = {"ampkit.integrations.lightning": "lightning", "ampkit.integrations.accelerate": "accelerate",
         "ampkit.integrations.transformers": "transformers"}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_all_is_the_released_list_and_every_name_resolves(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    module = importlib.import_module(name)
    assert module.__all__ == PUBLIC[name]
    assert [n for n in module.__all__ if not hasattr(module, n)] == []


@pytest.mark.parametrize("name", sorted(set(PUBLIC) - set(NEEDS)))
def test_a_public_module_is_itself_not_an_internal_one(name):
    module = importlib.import_module(name)
    assert module.__name__ == name and "._" not in module.__name__
