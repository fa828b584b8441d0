"""What summing a ghost form's float64 product in chunks of whole examples costs.

The ghost form's clipped sum is X @ Y with X = (f·G) as [c, B·T] and Y = A as [B·T, d]. Summed
in chunks of at most ``dpcore.clipping.GHOST_CHUNK_TERMS`` (example, position) terms, each
added into the result with ``addmm_`` (``dpcore.bookkeeping.base.GhostPart``), every term takes
far fewer roundings (docs/benchmarks/README.md). This times the product both ways, best of
three, on shapes of ResNet-9's and MiniLM's ghost layers.

    python docs/benchmarks/ghost_chunks.py
"""

import time

import torch

from dpcore.clipping import ghost_chunk

SHAPES = [(256, 64, 256, 2304), (64, 64, 256, 2304), (256, 16, 512, 4608), (128, 128, 1536, 384)]


def one(X: torch.Tensor, Y: torch.Tensor, step: int) -> torch.Tensor:
    return X @ Y


def chunked(X: torch.Tensor, Y: torch.Tensor, step: int) -> torch.Tensor:
    w = X[:, :step] @ Y[:step]
    for k in range(step, X.shape[1], step):
        w.addmm_(X[:, k : k + step], Y[k : k + step])
    return w


def main() -> None:
    torch.manual_seed(0)
    print("| B | T | c × d | one product (ms) | in chunks (ms) | chunks |")
    print("|---|---|---|---|---|---|")
    for B, T, c, d in SHAPES:
        X = torch.randn(c, B * T, dtype=torch.float64)
        Y = torch.randn(B * T, d, dtype=torch.float64)
        step = ghost_chunk(T) * T
        torch.testing.assert_close(one(X, Y, step), chunked(X, Y, step))
        best = {}
        for _ in range(3):
            for name, f in (("one", one), ("chunked", chunked)):
                t = time.perf_counter()
                f(X, Y, step)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
        chunks = -(-B * T // step)
        print(f"| {B} | {T} | {c} × {d} | {best['one'] * 1e3:.1f} | {best['chunked'] * 1e3:.1f} | {chunks} |")


if __name__ == "__main__":
    main()
