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
