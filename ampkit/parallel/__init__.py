"""Multi-process training on ``torch.distributed``: Apex's DDP wrapper, synchronized BatchNorm,
FSDP2 checkpoints; and Apex's LARC optimizer wrapper, which Apex kept in ``apex.parallel`` too."""
from .._parallel.distributed import DistributedDataParallel
from .._parallel.fsdp import full_state_dict, load_sharded, save_sharded
from .._parallel.larc import LARC
from .._parallel.sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group",
           "full_state_dict", "load_sharded", "save_sharded"]
