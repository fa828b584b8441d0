"""The optional compiled kernel (dpcore.native): same values as torch, the dense semantics for
non-finite values, and a clean fall-back to torch when it cannot be built or is switched off."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dpcore import native, native_build
from dpcore.bookkeeping.conv import conv_per_example as _conv_per_example
from dpcore.bookkeeping.conv import conv_per_example_torch as _conv_per_example_torch

needs_kernel = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler on this machine")


@needs_kernel
def test_kernel_builds_and_passes_its_self_check_where_a_compiler_exists():
    # Otherwise every kernel test below would silently test the torch path.
    assert native.load() is not None, native.state()


@needs_kernel
def test_kernel_matches_torch_over_random_geometries():
    """Random kernel sizes, strides, paddings, dilations, channels and output-gradient
    densities: the kernel's W equals torch's grouped weight gradient within float32
    rounding, and its squared norms equal the float64 sums of W's squares."""
    gen = torch.Generator().manual_seed(3)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for trial in range(60):
        kh, kw = pick(1, 6), pick(1, 9)
        sh, sw, dh, dw = pick(1, 3), pick(1, 3), pick(1, 2), pick(1, 2)
        ph, pw = pick(0, 3), pick(0, 3)
        cin, cout, batch = pick(1, 7), pick(1, 9), pick(1, 5)
        h = dh * (kh - 1) + 1 + pick(0, 8) - 2 * ph
        w = dw * (kw - 1) + 1 + pick(0, 8) - 2 * pw
        if h < 1 or w < 1:
            continue
        conv = nn.Conv2d(cin, cout, (kh, kw), stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw))
        a = torch.randn(batch, cin, h, w, generator=gen)
        out = conv(a).detach()
        density = float(torch.rand((), generator=gen))
        g = torch.randn(out.shape, generator=gen) * (torch.rand(out.shape, generator=gen) < density)
        got = native.conv2d_per_example(conv, a, g)
        assert got is not None, conv
        W, sq = got
        ref = _conv_per_example_torch(conv, a.double(), g.double())
        scale = ref.abs().max().item() + 1e-30
        assert (W.double() - ref).abs().max().item() <= 1e-5 * scale, (trial, conv, a.shape)
        exact = W.double().reshape(batch, -1).square().sum(1)
        assert torch.allclose(sq, exact, rtol=1e-12, atol=0), (trial, conv)


@needs_kernel
@pytest.mark.parametrize("cin, kh", [(1, 8), (3, 8), (1, 3), (2, 7), (5, 6), (1, 1), (4, 5)])
def test_rows_of_eight_read_from_the_input_match_torch(cin, kh):
    """Filters 8 wide (stride 1 along the row): the kernel reads the rows straight from the
    padded input, in blocks of 16, 8, 4, 2 and 1 rows (cin·kh of 8, 24, 3, 14, 30, 1 and 20
    take every block size). Many positions (more than one 16-wide vector of them, and not a
    multiple of 16) and sparse output gradients, as after a ReLU and max pooling: the values
    equal torch's within float32 rounding, and the squared norms are those of W itself."""
    gen = torch.Generator().manual_seed(cin * 100 + kh)
    conv = nn.Conv2d(cin, 6, (kh, 8), stride=2, padding=3)
    a = torch.randn(9, cin, 20 + kh, 27, generator=gen)  # 14 × 13 positions
    out = conv(a).detach()
    assert out.shape[2] * out.shape[3] % 16 != 0 and out.shape[2] * out.shape[3] > 16
    g = torch.randn(out.shape, generator=gen) * (torch.rand(out.shape, generator=gen) < 0.3)
    g[4] = 0.0  # an example with no gradient at all
    W, sq = native.conv2d_per_example(conv, a, g)
    ref = _conv_per_example_torch(conv, a.double(), g.double())
    assert (W.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(W[4], torch.zeros_like(W[4])) and sq[4].item() == 0.0
    assert torch.allclose(sq, W.double().reshape(9, -1).square().sum(1), rtol=1e-12, atol=0)


@needs_kernel
def test_non_finite_inputs_poison_the_example_as_in_the_dense_reference():
    """An inf in the input where every output gradient that touches it is zero: the dense
    product has 0·inf = NaN, so the example must come out non-finite (and be skipped by the
    caller), even though the kernel otherwise skips zero gradients. Other examples are
    unaffected."""
    conv = nn.Conv2d(2, 3, 3, padding=1)
    a = torch.randn(3, 2, 6, 6)
    g = torch.randn(3, 3, 6, 6)
    a[1, 0, 2, 2] = float("inf")
    g[1] = 0.0  # all zero: a sparse kernel that skips zeros would return exactly 0
    a[2, 1, 0, 0] = float("nan")
    W, sq = native.conv2d_per_example(conv, a, g)
    ref = _conv_per_example_torch(conv, a, g)
    assert torch.isnan(ref[1]).any() and torch.isnan(W[1]).any()
    assert not torch.isfinite(sq[1]) and not torch.isfinite(sq[2])
    assert torch.isfinite(sq[0]) and torch.allclose(W[0], ref[0], atol=1e-5)
    assert torch.equal(torch.isnan(W), torch.isnan(ref))
    # The same through the rows read straight from the input (filters 8 wide) and a sparse
    # output gradient over more than 16 positions.
    conv8 = nn.Conv2d(1, 4, 8, stride=2, padding=3)
    a = torch.randn(3, 1, 28, 28)
    g = torch.randn(3, 4, 14, 14) * (torch.rand(3, 4, 14, 14) < 0.2)
    a[1, 0, 5, 5] = float("inf")
    g[1] = 0.0
    g[2, 3, 7, 7] = float("-inf")
    W, sq = native.conv2d_per_example(conv8, a, g)
    ref = _conv_per_example_torch(conv8, a, g)
    assert torch.isnan(ref[1]).any() and torch.isnan(W[1]).any() and not torch.isfinite(sq[1])
    assert not torch.isfinite(sq[2]) and torch.isfinite(sq[0])
    assert torch.equal(torch.isnan(W), torch.isnan(ref)) and torch.allclose(W[0], ref[0], atol=1e-5)


def test_cases_outside_the_kernel_use_torch():
    """float64, non-contiguous inputs and wrong shapes: float64 goes to torch, non-contiguous
    inputs give the same values, and a gradient of the wrong shape is refused."""
    conv = nn.Conv2d(3, 4, 3, stride=2).double()
    a = torch.randn(5, 3, 9, 9, dtype=torch.float64)
    g = torch.randn(5, 4, 4, 4, dtype=torch.float64)
    assert native.conv2d_per_example(conv, a, g) is None
    W, sq = _conv_per_example(conv, a, g)
    assert sq is None and W.dtype == torch.float64
    conv32 = nn.Conv2d(3, 4, 3, stride=2)
    wrong = torch.randn(5, 4, 3, 3)
    assert native.conv2d_per_example(conv32, a.float(), wrong) is None
    if native.load() is not None:
        a_nc = torch.randn(9, 9, 3, 5).permute(3, 2, 0, 1)  # not contiguous
        g32 = torch.randn(5, 4, 4, 4)
        W1, _ = native.conv2d_per_example(conv32, a_nc, g32)
        W2, _ = native.conv2d_per_example(conv32, a_nc.contiguous(), g32)
        assert torch.equal(W1, W2)


_CHILD = r"""
import json, torch
from torch import nn
from dpcore import native
from dpcore.bookkeeping.conv import conv_per_example as _conv_per_example
conv = nn.Conv2d(8, 3, 3)  # rows of 72: a layer the kernel is chosen for
a, g = torch.randn(4, 8, 7, 7), torch.randn(4, 3, 5, 5)
W, sq = _conv_per_example(conv, a, g)
print(json.dumps({"state": native.state(), "used": sq is not None, "shape": list(W.shape)}))
"""


def _child(env_extra, tmp_path):
    env = {**os.environ, "DP_NATIVE_CACHE": str(tmp_path / "cache"), **env_extra}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_switched_off_or_unbuildable_kernel_falls_back_to_torch(tmp_path):
    off = _child({"DP_NATIVE": "0"}, tmp_path)
    assert off == {"state": "off (DP_NATIVE=0)", "used": False, "shape": [4, 3, 72]}
    broken = _child({"CC": "/bin/false"}, tmp_path)
    assert broken["state"].startswith("off (RuntimeError: the C compiler failed") and not broken["used"]
    assert broken["shape"] == [4, 3, 72]
    missing = _child({"CC": str(tmp_path / "no-such-compiler")}, tmp_path)
    assert missing["state"].startswith("off (") and not missing["used"]


def test_kernel_is_built_once_into_a_private_cache(tmp_path):
    if native_build.compiler() is None:
        pytest.skip("no C compiler here")
    first = _child({}, tmp_path)
    assert first["used"] and first["state"].startswith("on (" + str(tmp_path / "cache"))
    built = list((tmp_path / "cache").glob("dpcore-*.so"))
    assert len(built) == 1 and (tmp_path / "cache").stat().st_mode & 0o077 == 0
    mtime = built[0].stat().st_mtime_ns
    again = _child({}, tmp_path)
    assert again["used"] and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_a_cache_directory_others_can_write_is_not_used(tmp_path):
    """A shared library is loaded from the cache: a group/world-writable directory is refused
    (another user could plant a library there) and a private temporary directory is used."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler here")
    shared = tmp_path / "cache"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    got = _child({}, tmp_path)
    assert got["used"] and "dp-native-" in got["state"] and str(shared) not in got["state"]
    assert not list(shared.glob("*.so"))


def test_the_kernel_is_chosen_by_layer_shape_only():
    """The MNIST CNN's convolutions use the kernel; ResNet-9's (large patches, where torch's
    grouped convolution is faster) and rows narrower than one block do not. The rule never
    looks at values: the same shapes with other data give the same choice."""
    from pipelines.models import build_model

    def convs(model, shape):
        seen = []
        hooks = [
            m.register_forward_hook(lambda m, i, o: seen.append((m, o)))
            for m in model.modules()
            if isinstance(m, nn.Conv2d)
        ]
        model(torch.randn(2, *shape))
        for h in hooks:
            h.remove()
        return seen

    cnn = convs(build_model("cnn", (1, 28, 28), 10), (1, 28, 28))
    assert [native.worthwhile(m, o) for m, o in cnn] == [True, True]
    r9 = convs(build_model("resnet9", (3, 32, 32), 10), (3, 32, 32))
    assert len(r9) >= 8 and not any(native.worthwhile(m, o) for m, o in r9)
    assert not native.worthwhile(nn.Conv2d(1, 8, 3), torch.zeros(1, 8, 6, 6))  # 9-wide rows
    for m, o in cnn:
        assert native.worthwhile(m, torch.full_like(o, float("nan"))) == native.worthwhile(m, o)


def test_a_cache_under_a_directory_others_can_change_is_not_used(tmp_path):
    """A private cache directory inside a world-writable, non-sticky directory could be
    renamed and replaced by another user: refused. Under a sticky one (like /tmp): used."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler here")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    env = {"DP_NATIVE_CACHE": str(open_dir / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["used"] and "dp-native-" in got["state"] and not list((open_dir / "cache").glob("*.so"))
    open_dir.chmod(0o1777)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["used"] and got["state"].startswith("on (" + str(open_dir / "cache"))


def test_the_cache_key_ignores_the_clock_speed():
    assert "MHz" not in native_build.cpu_id() and "bogomips" not in native_build.cpu_id().lower()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_row_sums_are_float64_sums_of_the_rows_and_a_non_finite_row_stays_non_finite(threads):
    """row_stats gives ‖x‖², 1ᵀx and wᵀx of each row (filter r mod F) as float64 sums of exact
    terms: equal to torch's float64 sums to their rounding, on one thread or several; a row with
    a NaN or an infinity gives non-finite sums, the other rows are untouched."""
    gen = torch.Generator().manual_seed(9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows, n, filters in ((6, 37, 2), (256 * 3, 1152, 256), (5, 1, 5)):
            X = torch.randn(rows, n, generator=gen) * torch.logspace(-3, 3, rows).view(-1, 1)
            w = torch.randn(filters, n, generator=gen, dtype=torch.float64)
            X[1, 0] = float("nan")
            X[-1, -1] = float("inf")
            got = native.row_stats(X, w)
            x = X.double()
            want = torch.stack([x.square().sum(1), x.sum(1), (x * w.repeat(rows // filters, 1)).sum(1)], 1)
            bad = torch.zeros(rows, dtype=torch.bool)
            bad[[1, -1]] = True
            assert not torch.isfinite(got[bad]).all(1).any()
            torch.testing.assert_close(got[~bad], want[~bad], rtol=1e-12, atol=1e-12)
    finally:
        torch.set_num_threads(before)
    X, w = torch.randn(6, 8), torch.randn(2, 8, dtype=torch.float64)
    assert native.row_stats(X[:, :3], w) is None  # the widths must agree
    assert native.row_stats(X[:5], w) is None  # whole examples: a multiple of the filters
    assert native.row_stats(X.double(), w) is None  # float32 rows only
