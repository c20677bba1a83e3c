"""Multi-process training on ``torch.distributed``: Apex's DDP wrapper, synchronized BatchNorm,
FSDP2 checkpoints; and Apex's LARC optimizer wrapper, which Apex kept in ``apex.parallel`` too."""
from .distributed import DistributedDataParallel
from .fsdp import full_state_dict, load_sharded, save_sharded
from .larc import LARC
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group",
           "full_state_dict", "load_sharded", "save_sharded"]
