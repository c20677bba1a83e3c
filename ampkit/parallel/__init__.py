"""Multi-process training on ``torch.distributed``: Apex's DDP wrapper and synchronized BatchNorm;
and Apex's LARC optimizer wrapper, which Apex kept in ``apex.parallel`` too."""
from .distributed import DistributedDataParallel
from .larc import LARC
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]
