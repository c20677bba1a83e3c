"""Multi-process training on ``torch.distributed``: Apex's DDP wrapper and synchronized BatchNorm."""
from .distributed import DistributedDataParallel
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]
