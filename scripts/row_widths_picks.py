"""What the per-channel key widths pick (`kvarn.ops.widths`, the `kvarn-w` presets; docs/TASKS.md, "Bits spread over
a key tile's channels"): on a prompt's full-precision keys (tiles past the sink, the whole prompt's E[q q^T] as the
running statistics), per layer the share of key tiles kept rotated, the share of channels at 0-4 bits in the plain
tiles, and the mean width of the channels the queries weigh most.

    PYTHONPATH=$PWD .venv/bin/python scripts/row_widths_picks.py --seed 7 --indices 0
"""

from __future__ import annotations

import torch
from lloyd_max_bound import bound_parser, layer_tiles

from kvarn.ops.widths import width_targets
from kvarn.presets.family import widths_preset


def main() -> None:
    ap = bound_parser(__doc__.splitlines()[0])
    ap.add_argument("--mean-bits", type=float, default=2.0)
    ap.add_argument("--top", type=int, default=8, help="the channels of most query energy to report")
    args = ap.parse_args()
    total = torch.zeros(5)
    for layer, (_, _, _, sigma, x) in enumerate(layer_tiles(args)):
        x, sigma = x.float(), sigma.float()
        kq = widths_preset(mean=args.mean_bits).key(x.shape[2])
        rotated = kq.encode(x, sigma).rotated.bool()
        energy = sigma.diagonal(dim1=-2, dim2=-1)  # [N, D]
        b, s_col, s_row = kq._normalized(x.transpose(-1, -2))  # the plain basis, as the store encodes it
        w = width_targets(b, s_col, s_row, energy, round(args.mean_bits * x.shape[2]))[4][~rotated]  # [plain tiles, D]
        hist = torch.bincount(w.flatten(), minlength=5).float()
        total += hist
        top = energy[~rotated].argsort(-1, descending=True)[:, :args.top]
        print(f"layer {layer:2d}: rotated {rotated.float().mean():.2f}; channels at 0..4 bits "
              f"{(hist / hist.sum()).numpy().round(2)}; the {args.top} of most query energy "
              f"{w.gather(1, top).float().mean():.2f} bits")
    print(f"all layers: channels at 0..4 bits {(total / total.sum()).numpy().round(3)}")


if __name__ == "__main__":
    main()
