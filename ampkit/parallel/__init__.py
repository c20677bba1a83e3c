"""Multi-process training on ``torch.distributed``: Apex's DDP wrapper, synchronized BatchNorm, FSDP2 checkpoints."""
from .distributed import DistributedDataParallel
from .fsdp import full_state_dict, load_sharded, save_sharded
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group",
           "full_state_dict", "load_sharded", "save_sharded"]
