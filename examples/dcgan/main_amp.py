"""Apex's DCGAN example on ampkit: two models, two optimizers, three losses (``num_losses=3``).

    python examples/dcgan/main_amp.py --opt-level O5 --steps 200

The "real" images are generated in-process: 16x16 grey blobs at random places. Each loss
has its own loss scaler, so an overflow in one of them skips only its optimizer's step.
"""
import argparse

import torch
from torch import nn

import ampkit


def real_images(n: int, g: torch.Generator, size: int = 16) -> torch.Tensor:
    """``n`` images in [-1, 1]: one Gaussian blob each, random centre and width."""
    coords = torch.arange(size, dtype=torch.float32)
    centre = torch.rand(n, 2, generator=g) * (size - 6) + 3
    width = torch.rand(n, 1, 1, generator=g) * 2 + 1.5
    dy = (coords.view(1, size, 1) - centre[:, 0].view(n, 1, 1)) ** 2
    dx = (coords.view(1, 1, size) - centre[:, 1].view(n, 1, 1)) ** 2
    return (torch.exp(-(dx + dy) / (2 * width**2)) * 2 - 1).unsqueeze(1)


def generator(nz: int, ngf: int) -> nn.Module:
    return nn.Sequential(
        nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(),  # 4x4
        nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(),  # 8x8
        nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False), nn.Tanh(),  # 16x16
    )


def discriminator(ndf: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2),  # 8x8
        nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2),  # 4x4
        nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Flatten(),  # one logit per image
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O5", choices=sorted(ampkit.OPT_LEVELS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--nz", type=int, default=16, help="size of the latent vector")
    parser.add_argument("--ngf", type=int, default=32)
    parser.add_argument("--ndf", type=int, default=32)
    parser.add_argument("--print-freq", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    netG, netD = generator(args.nz, args.ngf).to(device), discriminator(args.ndf).to(device)
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    [netD, netG], [optimizerD, optimizerG] = ampkit.initialize(
        [netD, netG], [optimizerD, optimizerG], opt_level=args.opt_level, num_losses=3)
    criterion = nn.BCEWithLogitsLoss()  # outputs come back float32: the loss runs in float32
    data = torch.Generator().manual_seed(1)

    for step in range(args.steps):
        real = real_images(args.batch_size, data).to(device)
        ones = torch.ones(args.batch_size, 1, device=device)
        zeros = torch.zeros(args.batch_size, 1, device=device)

        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z))), one loss scaler per term
        netD.zero_grad()
        output = netD(real)
        errD_real = criterion(output, ones)
        with ampkit.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
            errD_real_scaled.backward()
        D_x = torch.sigmoid(output).mean().item()

        fake = netG(torch.randn(args.batch_size, args.nz, 1, 1, device=device))
        output = netD(fake.detach())
        errD_fake = criterion(output, zeros)
        with ampkit.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
            errD_fake_scaled.backward()
        D_G_z1 = torch.sigmoid(output).mean().item()
        optimizerD.step()

        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        output = netD(fake)
        errG = criterion(output, ones)
        with ampkit.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
            errG_scaled.backward()
        D_G_z2 = torch.sigmoid(output).mean().item()
        optimizerG.step()

        if step % args.print_freq == 0 or step == args.steps - 1:
            print(f"[{step}/{args.steps}] Loss_D: {(errD_real + errD_fake).item():.4f} Loss_G: {errG.item():.4f} "
                  f"D(x): {D_x:.4f} D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")
    print("loss scalers:", ampkit.state_dict())


if __name__ == "__main__":
    main()
