"""Apex-era training scripts, written as their users wrote them (``import apex``), tiny."""

IMAGENET = r'''
import argparse, os
import torch
import torch.nn.functional as F
from torch import nn
import apex
from apex import amp
from apex.parallel import DistributedDataParallel as DDP
from apex.parallel import convert_syncbn_model
from apex.fp16_utils import to_python_float

torch.set_num_threads(1)
parser = argparse.ArgumentParser()
parser.add_argument("--opt-level", type=str)
parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
parser.add_argument("--loss-scale", type=str, default=None)
parser.add_argument("--sync_bn", action="store_true")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--resume", default="")
parser.add_argument("--checkpoint", default="")
parser.add_argument("--out", default="")
args = parser.parse_args()

args.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
world, rank = 1, 0
if args.distributed:
    torch.distributed.init_process_group(backend="gloo", init_method="env://")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
if args.sync_bn:
    model = convert_syncbn_model(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                  keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
if args.distributed:
    model = DDP(model, delay_allreduce=True)

start = 0
if args.resume:
    checkpoint = torch.load(args.resume)
    start = checkpoint["step"]
    model.load_state_dict(checkpoint["state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])

criterion = nn.CrossEntropyLoss()
losses = []
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(step)
    images, target = torch.randn(8, 3, 8, 8, generator=g), torch.randint(5, (8,), generator=g)
    images, target = images[rank * 8 // world:(rank + 1) * 8 // world], target[rank * 8 // world:(rank + 1) * 8 // world]
    loss = criterion(model(images), target)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(to_python_float(loss))
    print("step %d loss %.4f scale %s" % (step, losses[-1], amp._amp_state.loss_scalers[0].loss_scale()))

if args.checkpoint and rank == 0:
    torch.save({"step": args.steps, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict()}, args.checkpoint)
if args.out:
    torch.save({"params": [p.detach().clone() for p in amp.master_params(optimizer)], "losses": losses,
                "scale": amp._amp_state.loss_scalers[0]._loss_scale,
                "opt_level": amp._amp_state.opt_properties.opt_level}, args.out + ".%d" % rank)
'''

GAN = r'''
import argparse
import torch
from torch import nn
from apex import amp

torch.set_num_threads(1)
parser = argparse.ArgumentParser()
parser.add_argument("--opt_level", default="O1")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--blowup-step", type=int, default=-1)
parser.add_argument("--out", default="")
opt = parser.parse_args()

torch.manual_seed(0)
netG = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
netD = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
[netD, netG], [optimizerD, optimizerG] = amp.initialize([netD, netG], [optimizerD, optimizerG],
                                                        opt_level=opt.opt_level, num_losses=3)
for i in range(opt.steps):
    g = torch.Generator().manual_seed(i)
    real, noise = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    ones, zeros = torch.ones(6, 1), torch.zeros(6, 1)
    netD.zero_grad()
    errD_real = criterion(netD(real), ones)
    with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
        errD_real_scaled.backward()
    fake = netG(noise)
    errD_fake = criterion(netD(fake.detach()), zeros)
    if i == opt.blowup_step:
        errD_fake = errD_fake * float("inf")
    with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
        errD_fake_scaled.backward()
    optimizerD.step()
    netG.zero_grad()
    errG = criterion(netD(fake), ones)
    with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
        errG_scaled.backward()
    optimizerG.step()
    print("[%d] Loss_D: %.4f Loss_G: %.4f" % (i, errD_real.item() + errD_fake.item(), errG.item()))
scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
print("scales", scales)
if opt.out:
    torch.save({"D": [p.detach().clone() for p in netD.parameters()], "G": [p.detach().clone() for p in netG.parameters()],
                "scales": scales, "amp": amp.state_dict()}, opt.out)
'''

FP16_OPTIMIZER = r'''
import sys
import torch
from torch import nn
from apex.fp16_utils import *

torch.set_num_threads(1)
steps, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = network_to_half(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0 ** 10}, verbose=False)
losses = []
for step in range(steps):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=g)
    y = x.sum(1, keepdim=True)
    optimizer.zero_grad()
    loss = (model(x).float() - y).pow(2).mean()
    optimizer.backward(loss)
    optimizer.clip_master_grads(5.0)
    optimizer.step()
    losses.append(to_python_float(loss))
    print("step %d loss %.4f scale %s" % (step, losses[-1], optimizer.loss_scale))
torch.save({"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
            "state": optimizer.state_dict()}, out)
'''

# How libraries decide that Apex is there (transformers' is_apex_available() reads find_spec
# and the package metadata), then what importing Apex's parts pulls in.
LIBRARY_CHECKS = r"""
import importlib.metadata, importlib.util, sys

def apex_available():
    if importlib.util.find_spec("apex") is None:
        return False
    try:
        return importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        return False

print("apex available:", apex_available())
print("apex distribution:", importlib.metadata.packages_distributions().get("apex"))
if apex_available():
    import apex
    from apex import amp, optimizers, parallel, fp16_utils, normalization
    from apex.optimizers import FusedAdam, FusedSGD, FusedLAMB, FusedNovoGrad
    from apex.multi_tensor_apply import multi_tensor_applier
    import amp_C
    print("amp holds:", "state_dict" in amp.__dict__, "load_state_dict" in amp.__dict__, "initialize" in dir(amp))
    print("heavy:", sorted(m for m in ("torchao", "torch.distributed.checkpoint", "torch.distributed.fsdp") if m in sys.modules))
"""

# A loss-scaler helper as vision repositories carry it: it saves and restores Apex's amp state
# only when the amp module's __dict__ has state_dict / load_state_dict.
VISION_SCALER = r"""
import argparse
import torch
from torch import nn
try:
    from apex import amp
except ImportError:
    amp = None

class AmpScaler:
    key = "amp"

    def __call__(self, loss, optimizer):
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()

    def state_dict(self):
        return amp.state_dict() if "state_dict" in amp.__dict__ else None

    def load_state_dict(self, state):
        if "load_state_dict" in amp.__dict__:
            amp.load_state_dict(state)

torch.set_num_threads(1)
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--blowup-step", type=int, default=-1)
parser.add_argument("--save", default="")
parser.add_argument("--resume", default="")
args = parser.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale="dynamic", verbosity=0)
scaler = AmpScaler()
if args.resume:
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint[scaler.key])
print("scale at start", amp._amp_state.loss_scalers[0].loss_scale())
for step in range(args.steps):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean() * (float("inf") if step == args.blowup_step else 1.0)
    optimizer.zero_grad()
    scaler(loss, optimizer)
if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), scaler.key: scaler.state_dict()}, args.save)
"""

# apex.optimizers.FusedAdam under amp O2, with a gradient norm from amp_C through
# multi_tensor_applier (as Megatron-style clipping code computes it); --torch runs the same
# with torch.optim.AdamW(fused=True) in its place.
FUSED_ADAM = r"""
import sys
import torch
from torch import nn
from apex import amp, optimizers
from apex.multi_tensor_apply import multi_tensor_applier
import amp_C

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
if "--torch" in sys.argv:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
else:
    optimizer = optimizers.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0, verbosity=0)
overflow = torch.zeros(1, dtype=torch.int)
for step in range(4):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step))
    loss = (model(x).float() - x.sum(1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    norm, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow, [grads], True)
    reference = torch.nn.utils.clip_grad_norm_(list(amp.master_params(optimizer)), float("inf"))
    print("step", step, "loss %.6f" % loss.item(), "norm %.6f %.6f" % (norm.item(), reference.item()), len(per_tensor))
    optimizer.step()
print("overflow flag", overflow.item(), type(optimizer).__name__, isinstance(optimizer, torch.optim.Optimizer))
torch.save([p.detach().clone() for p in model.parameters()], sys.argv[1])
"""

# What `apex_to_ampkit.diff` does by hand: the same scripts with ampkit imports.
MIGRATED_IMPORTS = [
    ("from apex.fp16_utils import *", "from ampkit.fp16_utils import *"),
    ("from apex.fp16_utils import", "from ampkit.fp16_utils import"),
    ("from apex.parallel import", "from ampkit.parallel import"),
    ("from apex import amp", "import ampkit as amp"),
    ("import apex\n", "\n"),
]


def migrated(source: str) -> str:
    for old, new in MIGRATED_IMPORTS:
        source = source.replace(old, new)
    assert "apex" not in source.replace("ampkit", ""), source
    return source
