"""The per-token kernels compiled for sm_90 on the CPU (no GPU needed): vectorized 16-byte accesses, and
every global load of a program issued before its first store, the property their docstrings claim (a
store may alias a later load for all the compiler knows, so a load after a store waits a round trip).

Compiled as a real launch sees the arguments: pointers and the strides of Qwen3-0.6B / Llama-3.1-8B
rows (multiples of 16) with 16-divisibility, eps and the FP8 scales as floats. Needs triton importable
and TRITON_INTERPRET off (see test_qk_norm_rope.py for installing it on a CPU-only checkout).
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import pytest

from conveyor.kernels import add_rms_norm, qk_norm_rope, rms_norm, rotary, splitk_linear, store_kv
from conveyor.kernels.triton_compat import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs Triton without its interpreter (compiles, no GPU needed)")


def sm90_ptx(kernel: Any, types: list[str], constants: dict[str, Any], num_warps: int, num_stages: int = 3,
             generic: tuple[str, ...] = ()) -> str:
    """The kernel's PTX for sm_90, compiled for 16-divisible pointers and integers but those named in `generic`
    (the kernel's `do_not_specialize`)."""
    compiler, target = importlib.import_module("triton.compiler"), importlib.import_module("triton.backends.compiler")
    signature = {**dict(zip(kernel.arg_names, types)), **{name: "constexpr" for name in constants}}
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(zip(kernel.arg_names, types))
               if kind != "fp32" and name not in generic}
    compiled = compiler.compile(compiler.ASTSource(kernel, signature, constants, aligned),
                                target=target.GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": num_stages})
    return str(compiled.asm["ptx"])


def global_accesses(kernel: Any, types: list[str], constants: dict[str, Any], num_warps: int) -> list[str]:
    """The kernel's PTX for sm_90 -> its global accesses in program order, e.g. ["ld.v4.b32", "st.v4.b32"]."""
    ptx = sm90_ptx(kernel, types, constants, num_warps)
    return [m.group(1) + m.group(2) for m in re.finditer(r"\b(ld|st)\.global((?:\.\w+)+)", ptx)]


def _assert_loads_then_stores(accesses: list[str], vectors: int) -> None:
    kinds = [access[:2] for access in accesses]
    assert "st" in kinds and kinds.index("st") == len(kinds) - kinds.count("st"), " ".join(accesses)
    assert sum(".v4." in access for access in accesses) >= vectors, " ".join(accesses)


CACHES = [None, "*bf16", "*fp8e4nv"]
"""The rope kernels' variants: no K/V store (today's launch), a store into a bf16 or an FP8 e4m3 cache."""


def _kv_store(cache: str | None) -> tuple[list[str], dict[str, Any]]:
    """The argument types and constexprs `store_kv.kv_store_args` gives a rope kernel (16-token blocks)."""
    types = ["*bf16", "*i64", cache or "*bf16", cache or "*bf16", "fp32", "fp32"] + ["i32"] * 8
    fp8 = cache == "*fp8e4nv"
    return types, {"BLOCK_SIZE": 16, "KV_FP8": fp8, "FP8_MAX": 448.0 if fp8 else 0.0, "STORE_KV": cache is not None}


@pytest.mark.parametrize("cache", CACHES, ids=["no-store", "bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("heads", [(16, 8), (64, 8)])  # Qwen3-0.6B; a 64-head model (8 warps)
def test_qk_norm_rope_loads_the_token_before_it_stores(heads: tuple[int, int], cache: str | None) -> None:
    q_pad, k_pad = heads
    store_types, store_constants = _kv_store(cache)
    constants = {"NUM_Q_HEADS": heads[0], "NUM_K_HEADS": heads[1], "Q_PAD": q_pad, "K_PAD": k_pad,
                 "HEAD_DIM": 128, "HALF": 64, **store_constants}
    accesses = global_accesses(qk_norm_rope._qk_norm_rope_kernel,
                               ["*bf16"] * 6 + ["i32"] * 5 + ["fp32"] + store_types, constants,
                               rotary.token_warps(q_pad + k_pad, 128))
    _assert_loads_then_stores(accesses, vectors=4)  # q's and k's halves in 16-byte vectors, loads and stores
    _assert_stores_kv(accesses, cache)


@pytest.mark.parametrize("cache", CACHES, ids=["no-store", "bf16-cache", "fp8-cache"])
def test_rotary_loads_the_token_before_it_stores(cache: str | None) -> None:
    store_types, store_constants = _kv_store(cache)
    constants = {"NUM_Q_HEADS": 32, "NUM_K_HEADS": 8, "Q_PAD": 32, "K_PAD": 8, "HALF": 64,  # Llama-3.1-8B
                 **store_constants}
    accesses = global_accesses(rotary._rotary_kernel, ["*bf16"] * 4 + ["i32"] * 5 + store_types, constants,
                               rotary.token_warps(40, 128))
    _assert_loads_then_stores(accesses, vectors=4)
    _assert_stores_kv(accesses, cache)


def _assert_stores_kv(accesses: list[str], cache: str | None) -> None:
    """With a store: the slot's 8-byte load, and K and V stored to the cache (4 stores more than q and k's 4,
    at least: the halves of K and of V); without, neither."""
    stores = [access for access in accesses if access.startswith("st")]
    assert ("ld.b64" in accesses) == (cache is not None), " ".join(accesses)
    assert (len(stores) >= 8) == (cache is not None), " ".join(accesses)


def test_store_kv_loads_the_rows_before_the_slot_decides() -> None:
    constants = {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HEADS_PAD": 8, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16,
                 "KV_FP8": False, "FP8_MAX": 0.0}
    accesses = global_accesses(store_kv._store_kv_kernel, ["*bf16"] * 4 + ["*i64", "fp32", "fp32"] + ["i32"] * 10,
                               constants, 4)
    assert accesses == ["ld.v4.b32", "ld.v4.b32", "ld.b64", "st.v4.b32", "st.v4.b32"]  # K, V, then the slot


@pytest.mark.parametrize("silu", [False, True], ids=["o_proj", "down_proj"])
def test_splitk_linear_compiles_for_qwen3s_projections(silu: bool) -> None:
    """The split-K kernel for Qwen3-0.6B's o_proj (K 2,048) and down_proj (the SwiGLU on load, K 3,072) at
    batch 256 with `splitk_plan`'s tile, warps and stages: sm_90's bf16 wgmma on tiles copied asynchronously in
    16-byte pieces (the pipelined loop), float32 partials stored in 16-byte vectors only."""
    n, k = (1024, 3072) if silu else (1024, 2048)
    plan = splitk_linear.splitk_plan(256, n, k)
    assert plan is not None
    constants = {"SILU": silu, "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k}
    ptx = sm90_ptx(splitk_linear._splitk_kernel, ["*bf16", "*bf16", "*fp32"] + ["i32"] * 6, constants,
                   plan.num_warps, plan.num_stages, generic=("M",))
    assert re.search(r"\bwgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16\b", ptx), "no bf16 wgmma"
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10\b", ptx), "no 16-byte async copy"
    assert re.findall(r"\bst\.global[.\w]*", ptx) and set(re.findall(r"\bst\.global[.\w]*", ptx)) == {"st.global.v4.b32"}
    assert ("ex2" in ptx) == silu  # the SwiGLU's exp only in the down projection's variant


@pytest.mark.parametrize("partials", [False, True], ids=["rows", "splitk-partials"])
def test_add_rms_norm_compiles_with_and_without_partials(partials: bool) -> None:
    """add_rms_norm's kernel at Qwen3-0.6B's width (1,024): with split-K partials x is float32 and the loop over
    the splits adds one more 16-byte load in its body; every access stays a 16-byte vector."""
    types = ["*fp32" if partials else "*bf16"] + ["*bf16"] * 4 + ["i32"] * 3 + ["fp32"] + ["i32"] * 2
    block, num_warps = rms_norm.row_launch(1024)
    accesses = global_accesses(add_rms_norm._add_rms_norm_kernel, types, {"PARTIALS": partials, "BLOCK": block},
                               num_warps)
    assert all(".v4." in access for access in accesses), " ".join(accesses)
    assert [access[:2] for access in accesses].count("ld") == (4 if partials else 3), " ".join(accesses)
