"""ragspeed's CPU kernels (engine.native.compute.cpu_kernels): the blocked products, their build and cache."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch

from ragspeed import environment
from ragspeed.engine.native.compute.cpu_kernels import BlockedWeight, build, decoder, load_library
from ragspeed.engine.native.compute.cpu_kernels.blocked import INT8_GROUP, Q6K_STEP
from ragspeed.engine.native.compute.quant.gguf_blocks import as_mixed, kernel_dequantize
from ragspeed.engine.native.compute.quant.groupwise import quantize_groupwise
from tests.engine.conftest import int16_rows

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="ragspeed's CPU kernels could not be built here"
)


def _weights(kind: str, n: int, k: int, gen: torch.Generator):
    weight = torch.randn(n, k, generator=gen)
    if kind == "fp32":
        return BlockedWeight, weight, weight, None
    int8 = quantize_groupwise(weight)
    return BlockedWeight, int8.dequantize(), int8.qweight, int8.scales


@pytest.mark.parametrize("kind", ["fp32", "int8"])
@pytest.mark.parametrize("n, k", [(16, 64), (37, 13), (100, 3), (1, 1), (49, 576), (20, 75)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_product_equals_x_at_w_transposed(kind, n, k, bias, threads):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    _, reference, weight, scales = _weights(kind, n, k, gen)
    b = torch.randn(n, generator=gen) if bias else None
    blocked = BlockedWeight(weight, b, scales)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13):
        x = torch.randn(rows, k, generator=gen)
        out = blocked.forward(x, threads)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        rounded = x if kind == "fp32" else int16_rows(x)
        expected = (rounded.double() @ reference.double().T + (0 if b is None else b)).float()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
        if kind == "int8":  # the activations' rounding, against fp32's product: small
            torch.testing.assert_close(out, x @ reference.T + (0 if b is None else b), rtol=0, atol=2e-3)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_a_row_gives_the_same_bits_alone_or_in_a_batch(kind):
    """Verification (1 + k rows) and batched decoding must reproduce plain decoding exactly."""
    gen = torch.Generator().manual_seed(7)
    _, _, weight, scales = _weights(kind, 200, 96, gen)
    blocked = BlockedWeight(weight, torch.randn(200, generator=gen), scales)
    x = torch.randn(13, 96, generator=gen)
    alone = torch.cat([blocked.forward(x[row : row + 1], 1) for row in range(13)])
    for num_rows in range(2, 14):  # passes of 1 .. 6 rows, and their combinations
        assert torch.equal(blocked.forward(x[:num_rows], 2), alone[:num_rows]), num_rows


def test_int8_group_size_is_the_librarys():
    assert load_library().ragspeed_int8_group() == INT8_GROUP == 32


def test_int8_product_does_not_saturate_with_extreme_values():
    """Full-range weights times full-range int16 activations: a group's int32 sum (32 x 127 x
    32767) and the int16 pair sums of vpmaddwd stay in range (no 16-bit sums of products as in
    fbgemm's AVX2 kernel)."""
    weight = torch.full((16, 64), 127, dtype=torch.int8)
    weight[:, 1::2] = -127
    weight[0] = 127
    scales = torch.full((16, 2), 0.5, dtype=torch.float16)
    blocked = BlockedWeight(weight, None, scales)
    x = torch.full((2, 64), 1000.0)
    x[0, 1] = -1000.0  # both signs at full range
    out = blocked.forward(x, 2)
    assert out[0, 0].item() == 62 * 127 * 0.5 * 1000.0  # 3,937,000: every term adds up
    assert out[1, 1].item() == 0.0  # +127 and -127 alternate


def test_blocked_int8_unblocks_to_what_it_was_given():
    gen = torch.Generator().manual_seed(5)
    int8 = quantize_groupwise(torch.randn(37, 75, generator=gen))
    blocked = BlockedWeight(int8.qweight, torch.randn(37, generator=gen), int8.scales)
    qweight, scales = blocked.unblocked()
    assert torch.equal(qweight, int8.qweight) and torch.equal(scales, int8.scales)
    assert blocked.scales.shape == (3, 3, 16)  # 37 columns -> 3 blocks; 75 inputs -> 3 groups
    assert blocked.blocks.shape == (3, 38, 16, 2)  # 75 inputs -> 38 pairs, the last padded
    assert blocked.num_bytes == 3 * 76 * 16 + 3 * 3 * 16 * 2 + 3 * 16 * 4  # fp16 scales, fp32 bias


def test_non_contiguous_input_and_bytes():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(20, 8, generator=gen)
    blocked = BlockedWeight(weight)
    x = torch.randn(8, 3, generator=gen).t()  # [3, 8], strided
    torch.testing.assert_close(blocked.forward(x, 2), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert blocked.blocks.shape == (2, 8, 16)  # 20 columns -> 2 blocks of 16, zero-padded
    assert blocked.num_bytes == 2 * 8 * 16 * 4


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """load_library() as a new process sees it, with its cache in tmp_path."""
    monkeypatch.setenv("RAGSPEED_KERNEL_CACHE", str(tmp_path))
    environment.configure()
    load_library.cache_clear()
    yield tmp_path
    load_library.cache_clear()


def test_the_library_is_compiled_once_into_the_cache(fresh_build):
    assert load_library() is not None
    built = list(fresh_build.glob("kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    load_library.cache_clear()
    assert load_library() is not None
    assert [p.stat().st_mtime_ns for p in fresh_build.glob("kernels-*.so")] == [stamp]
    assert not [p for p in fresh_build.iterdir() if p.is_dir()]  # no staging left behind


def test_turned_off_or_failed_build_means_no_kernels(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("RAGSPEED_CPU_KERNELS", "0")
    environment.configure()
    assert load_library() is None
    monkeypatch.delenv("RAGSPEED_CPU_KERNELS")
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    environment.configure()
    load_library.cache_clear()
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-DRAGSPEED_TEST_FLAGS",))  # a new cache key
    assert load_library() is None
    sources = "gemv.c + gemv_gguf.c + attention.c + rowwise.c + decoder.c + gemm_int8.c + prefill_attention.c"
    assert f"CPU kernels off: building {sources} failed" in caplog.text
    assert not list(fresh_build.glob("kernels-*.so"))


def test_every_exported_definition_has_its_prototype_in_the_header():
    sources = "\n".join(source.read_text() for source in build.SOURCES)
    defined = re.findall(r"^\w+ (ragspeed_\w+)\(", sources, re.MULTILINE)
    assert sorted(build.signatures(build.HEADER.read_text())) == sorted(defined)
    library = load_library()
    assert library.ragspeed_int8_group.restype is ctypes.c_int
    assert library.ragspeed_place_kv.argtypes[8] is ctypes.c_int64


ARGMAX = "void ragspeed_argmax(const float *x, int m, int n, int stride, int64_t *out);"


@pytest.mark.parametrize(
    "changed",
    [
        "void ragspeed_argmax(const float *x, int m, int n, int stride, int64_t *out, int extra);",
        "void ragspeed_argmax(const float *x, int m, int n, int64_t *out);",
        "void ragspeed_argmax(const float *x, int m, int n, float stride, int64_t *out);",
        "int ragspeed_argmax(const float *x, int m, int n, int stride, int64_t *out);",
    ],
)
def test_a_changed_prototype_changes_the_ctypes_signature(changed):
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    assert build.signatures(ARGMAX) == {"ragspeed_argmax": (None, [pointer] + [integer] * 3 + [pointer])}
    assert build.signatures(changed) != build.signatures(ARGMAX)


def test_a_prototype_without_a_ctypes_type_is_refused():
    with pytest.raises(ValueError, match="double"):
        build.signatures("void ragspeed_argmax(const float *x, double m);")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_compiler_refuses_a_definition_that_differs_from_the_header(tmp_path):
    definition = tmp_path / "definition.c"
    definition.write_text(
        '#include "kernels.h"\nvoid ragspeed_argmax(const float *x, int m, int n, int64_t *out) {}\n'
    )
    compiled = subprocess.run(
        ["cc", "-fsyntax-only", "-I", str(build.HEADER.parent), str(definition)],
        capture_output=True,
        text=True,
    )
    assert compiled.returncode != 0 and "ragspeed_argmax" in compiled.stderr


LAYOUT_PROBE = """#include <stddef.h>
#include <stdio.h>
#include "kernels.h"
int main(void) {
%s    return 0;
}
"""


def _c_layout(header: str, tmp_path) -> list[str]:
    """What the C compiler makes of the header's structs and enums: each struct's size, each
    field's offset and size, each enumerator's value, one `name value` a line."""
    lines = []
    for struct, members in build.fields(header).items():
        lines.append(f'    printf("{struct} %zu\\n", sizeof({struct}));\n')
        for name, _ in members:
            lines.append(
                f'    printf("{struct}.{name} %zu %zu\\n", offsetof({struct}, {name}), sizeof((({struct} *)0)->{name}));\n'
            )
    for name in build.enums(header):
        lines.append(f'    printf("{name} %d\\n", (int){name});\n')
    (tmp_path / "kernels.h").write_text(header)
    (tmp_path / "probe.c").write_text(LAYOUT_PROBE % "".join(lines))
    subprocess.run(
        ["cc", "-I", str(tmp_path), str(tmp_path / "probe.c"), "-o", str(tmp_path / "probe")], check=True
    )
    return subprocess.run(
        [str(tmp_path / "probe")], check=True, capture_output=True, text=True
    ).stdout.splitlines()


def _ctypes_layout(header: str) -> list[str]:
    """The same from the ctypes structures and enum values the parser reads from the header."""
    lines = []
    for struct, structure in build.structures(header).items():
        lines.append(f"{struct} {ctypes.sizeof(structure)}")
        for name, _ in structure._fields_:
            field = getattr(structure, name)
            lines.append(f"{struct}.{name} {field.offset} {field.size}")
    return lines + [f"{name} {value}" for name, value in build.enums(header).items()]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_python_structs_have_the_c_layout(tmp_path):
    header = build.HEADER.read_text()
    assert _ctypes_layout(header) == _c_layout(header, tmp_path)


DRIFTED = """typedef struct {
    int n, k;
    const float *bias; /* moved */
} Linear;
enum WeightKind { WEIGHT_A, WEIGHT_B = 4, WEIGHT_C };
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_changed_struct_or_enum_changes_the_python_layout(tmp_path):
    assert build.fields(DRIFTED) == {"Linear": [("n", "int"), ("k", "int"), ("bias", "float *")]}
    assert build.enums(DRIFTED) == {"WEIGHT_A": 0, "WEIGHT_B": 4, "WEIGHT_C": 5}
    assert _ctypes_layout(DRIFTED) == _c_layout(DRIFTED, tmp_path)
    assert _ctypes_layout(DRIFTED) != _ctypes_layout(build.HEADER.read_text())


def test_the_decoder_structs_and_weight_kinds_are_the_headers():
    header = build.HEADER.read_text()
    assert {name: [f for f, _ in s._fields_] for name, s in build.structures(header).items()} == {
        "Linear": ["w", "scale", "bias", "n", "k", "kind"],
        "Layer": ["input_norm", "post_norm", "qk_norm", "qkv", "o", "gate_up", "down"],
        "Model": [
            "layers", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter",
            "eps", "scale", "final_norm", "embed", "embed_q8", "lm_head",
        ],
    }  # fmt: skip
    assert [f for f, _ in decoder._Model._fields_] == [
        f for f, _ in build.structures(header)["Model"]._fields_
    ]
    assert decoder._Model._fields_[0][1]._type_ is decoder._Layer  # Layer *layers
    # every blocked kind runs in the decoder, each its own WEIGHT_*
    assert decoder._KINDS == {"fp32": 0, "int8": 1, "q4": 2, "q4k": 3, "q6k": 4, "kmix": 5}
    assert sorted(decoder._KINDS.values()) == sorted(build.enums(header).values())
    with pytest.raises(AssertionError, match="Linear has the fields"):
        decoder._filled(decoder._Linear, w=0, scale=0, bias=0, n=1, k=1)  # kind left out


@pytest.mark.parametrize("score_scale", [0.125, 40.0])  # 40: most weights underflow to 0
# 5 and 40: contexts that end inside a block, heads that end inside a vector
@pytest.mark.parametrize("block_size, head_dim", [(16, 32), (5, 40)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_decode_attention_over_a_long_scattered_context(score_scale, block_size, head_dim, kv_dtype):
    check_decode_attention(score_scale, block_size, head_dim, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_decode_attention_in_plain_c(fresh_build, monkeypatch, kv_dtype):
    """Built without AVX2, the kernel's generic sums give the same attention."""
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-mno-avx2",))
    check_decode_attention(0.125, 16, 64, kv_dtype)


@pytest.mark.parametrize("flags", [(), ("-mno-avx2",), ("-mno-avx512f",)])
def test_kv_writes_round_to_fp16_as_torch_does(fresh_build, monkeypatch, flags):
    """The fp16 KV pool's writes (F16C, or plain C without AVX2): nearest, ties to even,
    subnormals, overflow to infinity, NaN kept."""
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + flags)
    steps = torch.arange(-2000, 2000, dtype=torch.float32)
    values = torch.cat(
        [
            torch.randn(997, generator=torch.Generator().manual_seed(3)) * 100,
            (steps + 0.5) / 1024,  # ties between fp16 steps of 1 / 1024
            steps * 2**-26,  # fp16 subnormals and their ties
            torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -7e4, float("inf"), -float("inf")]),
        ]
    )
    out = torch.empty(len(values), dtype=torch.float16)
    load_library().ragspeed_to_f16(values.data_ptr(), out.data_ptr(), len(values))
    assert torch.equal(out.view(torch.int16), values.half().view(torch.int16))
    nans, out = torch.full((20,), float("nan")), torch.empty(20, dtype=torch.float16)
    load_library().ragspeed_to_f16(nans.data_ptr(), out.data_ptr(), len(nans))
    assert out.isnan().all()


@pytest.mark.parametrize("flags", [(), ("-mno-avx2",), ("-mno-avx512f",)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_steps_kv_writes_equal_index_copy(fresh_build, monkeypatch, flags, kv_dtype):
    """Rows of a wider tensor (q, k and v split from one projection) into scattered slots: the
    pool holds what index_copy_ writes, bit for bit, and nothing else changes."""
    from ragspeed.engine.native.compute.cpu_kernels.placement import write_kernel_applies, write_kv

    monkeypatch.setattr(build, "FLAGS", build.FLAGS + flags)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(37, 5, 24, generator=gen) * 300  # fp16's large and tiny values alike
    k, v = qkv[:, 3], qkv[:, 4]  # [37, 24]: one KV head of 24, rows 120 floats apart
    k, v = k.view(37, 1, 24), v.view(37, 1, 24)
    slots = torch.randperm(100, generator=gen)[:37]
    before = [torch.randn(100, 1, 24, generator=gen).to(kv_dtype) for _ in range(2)]
    pools = [pool.clone() for pool in before + before]
    assert write_kernel_applies(k, v, pools[0])
    write_kv(k, v, pools[0], pools[1], slots, 2)
    pools[2].index_copy_(0, slots, k.to(kv_dtype))
    pools[3].index_copy_(0, slots, v.to(kv_dtype))
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


def check_decode_attention(score_scale, block_size, head_dim, kv_dtype=torch.float32):
    """Two requests (1,000 and 37 tokens) over blocks in random order against softmax(q K^T) V
    (of the pool's keys and values widened to fp32); on one thread or two, a row alone, in the
    batch or among rows over the same blocks (a verification's, read once for all): the same
    bits."""
    from ragspeed.engine.native.compute.cpu_kernels.attention import paged_decode_attention

    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads = 6, 2
    lengths = [1000, 37]
    num_blocks = -(-1000 // block_size)  # per table; the pool holds more, in random order
    pool_blocks = num_blocks + 17
    tables = torch.stack([torch.randperm(pool_blocks, generator=gen)[:num_blocks] for _ in lengths])
    k_cache = torch.randn(pool_blocks * block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pool_blocks * block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    q = torch.randn(2, num_heads, head_dim, generator=gen)
    lens = torch.tensor(lengths)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, score_scale)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        keys = k_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, H, D]
        values = v_cache[slots].float().repeat_interleave(num_heads // num_kv_heads, dim=1)
        weights = (torch.einsum("hd,thd->ht", q[i], keys) * score_scale).softmax(-1)
        expected = torch.einsum("ht,thd->hd", weights, values)
        torch.testing.assert_close(out[i], expected, rtol=1e-4, atol=1e-5)
    threaded = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, score_scale, 2)
    assert torch.equal(threaded, out)
    alone = paged_decode_attention(q[1:], k_cache, v_cache, tables[1:], lens[1:], block_size, score_scale)
    assert torch.equal(alone[0], out[1])
    verification_lens = torch.tensor([997, 998, 1000])
    rows = torch.randn(3, num_heads, head_dim, generator=gen)
    together = paged_decode_attention(
        rows, k_cache, v_cache, tables[:1].repeat(3, 1), verification_lens, block_size, score_scale, 2
    )
    for i, n in enumerate(verification_lens.tolist()):
        row = paged_decode_attention(
            rows[i : i + 1], k_cache, v_cache, tables[:1], torch.tensor([n]), block_size, score_scale
        )
        assert torch.equal(together[i], row[0])


def check_every_group_size(kv_dtype, head_dim=64, block_size=16):
    """Query heads per KV head 1 to 5, contexts of odd lengths across block and chunk boundaries
    in one batch: each row equals softmax(q K^T) V of the pool's keys and values widened to fp32,
    and has the bits it has alone."""
    from ragspeed.engine.native.compute.cpu_kernels.attention import paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    lengths = [1, 3, 15, 17, 63, 65, 127, 131, 333]
    num_kv_heads, score_scale = 2, head_dim**-0.5
    num_blocks = -(-max(lengths) // block_size)
    pool_blocks = num_blocks + 5
    tables = torch.stack([torch.randperm(pool_blocks, generator=gen)[:num_blocks] for _ in lengths])
    lens = torch.tensor(lengths)
    k_cache = torch.randn(pool_blocks * block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(pool_blocks * block_size, num_kv_heads, head_dim, generator=gen).to(kv_dtype)
    for group in (1, 2, 3, 4, 5):
        num_heads = group * num_kv_heads
        q = torch.randn(len(lengths), num_heads, head_dim, generator=gen) * 2
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, score_scale, 2)
        for i, (table, n) in enumerate(zip(tables, lengths)):
            slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
            keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
            values = v_cache[slots].float().repeat_interleave(group, dim=1)
            weights = (torch.einsum("hd,thd->ht", q[i], keys) * score_scale).softmax(-1)
            expected = torch.einsum("ht,thd->hd", weights, values)
            torch.testing.assert_close(out[i], expected, rtol=1e-4, atol=1e-5, msg=f"group {group}, {n} keys")
            alone = paged_decode_attention(
                q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], block_size, score_scale
            )
            assert torch.equal(alone[0], out[i]), f"group {group}, {n} keys"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (40, 5)])
def test_decode_attention_for_every_group_size(kv_dtype, head_dim, block_size):
    check_every_group_size(kv_dtype, head_dim, block_size)


@pytest.mark.parametrize("without", ["-mno-avx512f", "-mno-avx2"])
def test_decode_attention_for_every_group_size_without_avx512_or_avx2(fresh_build, monkeypatch, without):
    """Built without AVX-512 (its AVX2 sums) or without AVX2 (plain C), the same attention."""
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + (without,))
    for kv_dtype in (torch.float32, torch.float16):
        check_every_group_size(kv_dtype)
        check_every_group_size(kv_dtype, head_dim=40, block_size=5)


@pytest.mark.parametrize("rows, dim", [(1, 576), (3, 37), (100, 64)])  # 100 rows: threaded
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_torch(rows, dim, with_residual):
    from ragspeed.engine.native.compute.cpu_kernels.norm import add_rms_norm

    gen = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=gen)
    residual = torch.randn(rows, dim, generator=gen) if with_residual else None
    weight = torch.randn(dim, generator=gen)
    stream = x + residual if with_residual else x.clone()
    expected = torch.nn.functional.rms_norm(stream, (dim,), weight, 1e-6)
    out = add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, stream)  # the stream's new value, written into x


@pytest.mark.parametrize("n, k", [(37, 75), (49, 576), (16, 1)])
def test_int8_products_in_plain_c(fresh_build, monkeypatch, n, k):
    """Built without AVX2 (as for a CPU that lacks it), the int8 kernel's plain-C sums give the
    product the intrinsics give, a row alone or in a batch."""
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-mno-avx2",))
    gen = torch.Generator().manual_seed(n + k)
    int8 = quantize_groupwise(torch.randn(n, k, generator=gen))
    b = torch.randn(n, generator=gen)
    blocked = BlockedWeight(int8.qweight, b, int8.scales)
    x = torch.randn(7, k, generator=gen)
    out = blocked.forward(x, 2)
    expected = (int16_rows(x).double() @ int8.dequantize().double().T + b).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(blocked.forward(x[2:3], 1), out[2:3])


def _four_bit(n: int, k: int, gen: torch.Generator):
    """Random 4-bit values and fp16 steps and offsets, and the fp32 weight they stand for."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.randn(n, k // INT8_GROUP, 2, generator=gen) * 0.05).half()
    d, m = (scales[:, :, i].float().repeat_interleave(INT8_GROUP, dim=1) for i in (0, 1))
    return q, scales, q.float() * d + m


@pytest.mark.parametrize("n, k", [(16, 32), (37, 64), (49, 576), (1, 96), (100, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_four_bit_product_equals_the_weight_it_stands_for(n, k, threads):
    gen = torch.Generator().manual_seed(n * 7 + k)
    q, scales, reference = _four_bit(n, k, gen)
    b = torch.randn(n, generator=gen)
    blocked = BlockedWeight(q, b, scales)
    assert blocked.kind == "q4" and blocked.blocks.shape == (-(-n // 16), k // 2, 16)
    for rows in (1, 2, 5, 6, 7, 13):
        x = torch.randn(rows, k, generator=gen)
        out = blocked.forward(x, threads)
        expected = (int16_rows(x).double() @ reference.double().T + b).float()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_four_bit_rows_give_the_same_bits_alone_or_in_a_batch():
    gen = torch.Generator().manual_seed(11)
    q, scales, _ = _four_bit(200, 96, gen)
    blocked = BlockedWeight(q, torch.randn(200, generator=gen), scales)
    x = torch.randn(13, 96, generator=gen)
    alone = torch.cat([blocked.forward(x[row : row + 1], 1) for row in range(13)])
    for num_rows in range(2, 14):
        assert torch.equal(blocked.forward(x[:num_rows], 2), alone[:num_rows]), num_rows


def test_four_bit_extremes_do_not_saturate():
    """15 x 32767 x 32 inputs a group stays in int32; offsets of both signs add up."""
    q = torch.full((16, 64), 15, dtype=torch.uint8)
    scales = torch.zeros(16, 2, 2, dtype=torch.float16)
    scales[:, :, 0], scales[:, :, 1] = 0.5, -2.0
    x = torch.full((1, 64), 1000.0)
    out = BlockedWeight(q, None, scales).forward(x, 2)
    assert torch.all(out == 64 * (15 * 0.5 - 2.0) * 1000.0)


def test_four_bit_needs_whole_groups():
    with pytest.raises(AssertionError, match="groups of 32"):
        BlockedWeight(
            torch.zeros(16, 48, dtype=torch.uint8), None, torch.zeros(16, 2, 2, dtype=torch.float16)
        )


@pytest.mark.parametrize("n, k", [(37, 64), (49, 576)])
@pytest.mark.parametrize("without", ["-mno-avx512vnni", "-mno-avx2", "-mno-avx512f"])
def test_four_bit_products_without_vnni_avx512_or_avx2(fresh_build, monkeypatch, n, k, without):
    """Built for a CPU without AVX-512 VNNI (AVX-512's multiply-add then add), without AVX-512
    (its AVX2 kernel) or without AVX2 (plain C), the 4-bit kernel gives the product of the
    weight it stands for, a row alone or in a batch."""
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + (without,))
    gen = torch.Generator().manual_seed(n + k)
    q, scales, reference = _four_bit(n, k, gen)
    b = torch.randn(n, generator=gen)
    blocked = BlockedWeight(q, b, scales)
    x = torch.randn(7, k, generator=gen)
    out = blocked.forward(x, 2)
    expected = (int16_rows(x).double() @ reference.double().T + b).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(blocked.forward(x[2:3], 1), out[2:3])


@pytest.mark.parametrize("flags", [(), ("-mno-avx2",), ("-mno-avx512f",)])
def test_argmax_is_torchs_first_largest(fresh_build, monkeypatch, flags):
    """The greedy token of each row, built for each vector width: the first of equal largest
    values, wherever it lies in the row (a vector's lane, the tail past whole vectors)."""
    from ragspeed.engine.native.compute.cpu_kernels.argmax import argmax

    monkeypatch.setattr(build, "FLAGS", build.FLAGS + flags)
    gen = torch.Generator().manual_seed(11)
    for vocab in (1, 7, 16, 17, 33, 49155):
        logits = torch.randn(5, vocab, generator=gen)
        logits[1] = 0.0  # all equal: index 0
        logits[2, -1] = 100.0  # the last, in the tail
        if vocab > 3:
            logits[3, [1, vocab - 2]] = 50.0  # a tie across lanes: the first
        logits[4, : vocab // 2] = -float("inf")
        assert argmax(logits) == logits.argmax(dim=-1).tolist(), vocab
    wide = torch.randn(3, 40, generator=gen)
    assert argmax(wide[:, :33]) == wide[:, :33].argmax(dim=-1).tolist()  # rows of a wider tensor
    assert load_library() is not None


def _k_quant(kind: str, n: int, k: int, gen: torch.Generator):
    """Random integers and fp32 scales of a K-quant kind (engine.native.compute.quant.k_quants' layouts), and
    the fp32 weight they stand for: q4k 4-bit q with a step and an offset per 32 inputs, q6k
    int8 q in -32..31 with a step per 16; kmix rows of both and of Q8_0's full int8 with an
    fp16 step per 32, converted to the mixed kind (engine.native.compute.quant.gguf_blocks.as_mixed), the
    weight `kernel_dequantize` gives for them."""
    if kind == "kmix":
        parts = [_k_quant("q4k", n - n // 2, k, gen)[:2], _k_quant("q6k", n // 3, k, gen)[:2]]
        q8 = torch.randint(-128, 128, (n // 2 - n // 3, k), generator=gen, dtype=torch.int8)
        parts.append((q8, (torch.rand(len(q8), k // INT8_GROUP, generator=gen) * 0.001).half()))
        pairs = [as_mixed(*part) for part in parts]
        q, scales = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        return q, scales, kernel_dequantize(q, scales)
    if kind == "q4k":
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = torch.randn(n, k // INT8_GROUP, 2, generator=gen) * 0.05
        step, offset = (scales[:, :, i].repeat_interleave(INT8_GROUP, dim=1) for i in (0, 1))
        return q, scales, q.float() * step + offset
    q = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    steps = torch.randn(n, k // Q6K_STEP, generator=gen) * 0.01
    return q, steps, q.float() * steps.repeat_interleave(Q6K_STEP, dim=1)


@pytest.mark.parametrize("kind", ["q4k", "q6k", "kmix"])
@pytest.mark.parametrize("n, k", [(16, 32), (37, 64), (49, 576), (1, 96), (100, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_k_quant_product_equals_the_weight_it_stands_for(kind, n, k, threads):
    gen = torch.Generator().manual_seed(n * 7 + k)
    q, scales, reference = _k_quant(kind, n, k, gen)
    b = torch.randn(n, generator=gen)
    blocked = BlockedWeight(q, b, scales)
    assert blocked.kind == kind
    weight, unblocked_scales = blocked.unblocked()
    assert torch.equal(weight, q) and torch.equal(unblocked_scales, scales)
    for rows in (1, 2, 5, 6, 7, 13):
        x = torch.randn(rows, k, generator=gen)
        out = blocked.forward(x, threads)
        expected = (int16_rows(x).double() @ reference.double().T + b).float()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["q4k", "q6k", "kmix"])
def test_k_quant_rows_give_the_same_bits_alone_or_in_a_batch(kind):
    gen = torch.Generator().manual_seed(12)
    q, scales, _ = _k_quant(kind, 200, 96, gen)
    blocked = BlockedWeight(q, torch.randn(200, generator=gen), scales)
    x = torch.randn(13, 96, generator=gen)
    alone = torch.cat([blocked.forward(x[row : row + 1], 1) for row in range(13)])
    for num_rows in range(2, 14):
        assert torch.equal(blocked.forward(x[:num_rows], 2), alone[:num_rows]), num_rows


def test_k_quant_extremes_do_not_saturate():
    """Q6_K's -32 x 32767 x 16 inputs a step stays in int32; steps of both signs add up."""
    q = torch.full((16, 64), -32, dtype=torch.int8)
    steps = torch.tensor([0.5, -2.0, 0.25, 1.0]).repeat(16, 1)
    x = torch.full((1, 64), 1000.0)
    out = BlockedWeight(q, None, steps).forward(x, 2)
    assert torch.all(out == 16 * -32 * (0.5 - 2.0 + 0.25 + 1.0) * 1000.0)
    # The mixed kind: Q8_0's -128 x 32767 x 16 a step; each group's offset on its 32 inputs.
    q = torch.full((16, 64), -128, dtype=torch.int8)
    scales = torch.tensor([[0.5, -2.0, 3.0], [0.25, 1.0, -1.0]]).repeat(16, 1, 1)
    out = BlockedWeight(q, None, scales).forward(x, 2)
    expected = (16 * -128 * (0.5 - 2.0 + 0.25 + 1.0) + 32 * (3.0 - 1.0)) * 1000.0
    torch.testing.assert_close(out, torch.full((1, 16), expected), rtol=1e-6, atol=0)


def test_k_quants_need_whole_groups():
    with pytest.raises(AssertionError, match="q6k weights come in groups of 32"):
        BlockedWeight(torch.zeros(16, 48, dtype=torch.int8), None, torch.zeros(16, 3))
    with pytest.raises(AssertionError, match=r"q4k weights need scales of shape \(16, 2, 2\)"):
        BlockedWeight(torch.zeros(16, 64, dtype=torch.uint8), None, torch.zeros(16, 4, 2))
    with pytest.raises(AssertionError, match=r"kmix weights need scales of shape \(16, 2, 3\)"):
        BlockedWeight(torch.zeros(16, 64, dtype=torch.int8), None, torch.zeros(16, 2, 2))


@pytest.mark.parametrize("without", ["-mno-avx512vnni", "-mno-avx2", "-mno-avx512f"])
def test_k_quant_products_without_vnni_avx512_or_avx2(fresh_build, monkeypatch, without):
    """Built without AVX-512 VNNI, AVX-512 or AVX2 (plain C), each K-quant kernel gives the
    product of the weight it stands for, a row alone or in a batch."""
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + (without,))
    gen = torch.Generator().manual_seed(5)
    for kind in ("q4k", "q6k", "kmix"):
        q, scales, reference = _k_quant(kind, 49, 576, gen)
        b = torch.randn(49, generator=gen)
        blocked = BlockedWeight(q, b, scales)
        x = torch.randn(7, 576, generator=gen)
        out = blocked.forward(x, 2)
        expected = (int16_rows(x).double() @ reference.double().T + b).float()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
        assert torch.equal(blocked.forward(x[2:3], 1), out[2:3]), kind


@pytest.mark.parametrize(("isa", "built"), [("avx2", "avx2"), ("plain", "plain C")])
def test_the_environment_narrows_the_kernels_to_a_smaller_cpu(fresh_build, monkeypatch, isa, built):
    """RAGSPEED_CPU_ISA builds the kernels for a narrower CPU than this one, so that a machine
    with AVX-512 runs (and tests) the AVX2-only machine's code."""
    from ragspeed.engine.native.compute.cpu_kernels.int8_prefill import isa_of

    monkeypatch.setenv("RAGSPEED_CPU_ISA", isa)
    environment.configure()
    for asked in (None, "native", isa):  # never wider than the environment allows
        library = load_library(asked)
        assert library is not None and isa_of(library) == built
    monkeypatch.setenv("RAGSPEED_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="RAGSPEED_CPU_ISA must be one of native, avx2, plain, got 'avx9'"):
        environment.configure()
