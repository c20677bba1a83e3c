"""A small transformer LM with low-precision LayerNorm: ``initialize(..., low_precision_layernorm=True)``.

    python examples/transformer_lpln/train.py --opt-level O4 --steps 100
    python examples/transformer_lpln/train.py --opt-level O4 --no-lpln     # compare

Under autocast (O1/O4) LayerNorm may run in float32: always on CUDA, and on CPU whenever
its input is float32, as the residual stream of a pre-norm transformer is. With
``low_precision_layernorm=True`` every ``nn.LayerNorm`` becomes
``ampkit.normalization.LPLayerNorm`` and runs in the autocast dtype. The script prints
the dtype each LayerNorm produced on the first step (``--no-lpln``: float32 here).
"""
import argparse
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


class LM(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        return self.head(self.norm(self.encoder(h, mask=self.causal[:t, :t], is_causal=True)))


def sequences(g: torch.Generator, successors: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Token sequences from a fixed sparse Markov chain (4 likely successors per token)."""
    tokens = torch.empty(batch, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(len(successors), (batch,), generator=g)
    for t in range(length):
        tokens[:, t + 1] = successors[tokens[:, t], torch.randint(4, (batch,), generator=g)]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O4", choices=["O1", "O4"])
    parser.add_argument("--no-lpln", action="store_true", help="keep nn.LayerNorm (for comparison)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    vocab = 256
    model = LM(vocab, args.d_model, 4, args.layers, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level,
                                         low_precision_layernorm=not args.no_lpln)

    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    seen = Counter()
    hooks = [m.register_forward_hook(lambda m, i, out: seen.update([f"{type(m).__name__} -> {out.dtype}"])) for m in norms]
    g = torch.Generator().manual_seed(1)
    successors = torch.randint(vocab, (vocab, 4), generator=g)
    for step in range(args.steps):
        tokens = sequences(g, successors, args.batch_size, args.seq_len)
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        with ampkit.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step == 0:
            for h in hooks:
                h.remove()
            print("LayerNorm outputs on the first step:", ", ".join(f"{n} x {k}" for k, n in sorted(seen.items())))
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
