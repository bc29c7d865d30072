"""The same contract on torch_xla's CPU device (PJRT_DEVICE=CPU): DLPack both ways, output on xla."""

import pytest
import torch
from helpers import assert_matches_reference, make_qkv

import torch_splash
from torch_splash import _compat
from torch_splash.masks import CausalMask

CASES = [
    ((2, 2), (64, 64), 7, 7, "causal", torch.float32),
    ((8, 4), (64, 32), 129, 129, None, torch.float32),
    ((4, 1), (128, 128), 1, 300, CausalMask(299), torch.float32),
    ((6, 2), (64, 64), 127, 127, "causal", torch.bfloat16),
]


@pytest.mark.parametrize("heads,dims,q_len,kv_len,mask,dtype", CASES)
def test_matches_sdpa_on_xla_device(xla_device, heads, dims, q_len, kv_len, mask, dtype):
    q, k, v = make_qkv(2, *heads, q_len, kv_len, *dims, dtype, device=xla_device)
    assert q.device.type == "xla"
    assert_matches_reference(q, k, v, mask)


def test_segment_ids_on_xla_device(xla_device):
    q, k, v = make_qkv(2, 4, 2, 150, 150, 64, 64, torch.float32, device=xla_device)
    ids = torch.zeros(2, 150, dtype=torch.int32)
    ids[:, 70:] = 1
    assert_matches_reference(q, k, v, "causal", segment_ids=ids.to(xla_device))


def test_pending_lazy_ops_are_materialised_not_fatal(xla_device):
    """to_dlpack on an unexecuted lazy tensor aborts the process in torch_xla; the DLPack transport
    executes the pending graph first (the automatic choice would take the graph transport here)."""

    base = [t.detach() for t in make_qkv(1, 2, 2, 32, 32, 64, 64, torch.float32, device=xla_device)]
    q, k, v = (t * 2 + 1 for t in base)  # pending graph, never executed
    assert _compat.needs_materialization_each([q, k, v]) == [True] * 3
    out = torch_splash.attention(q, k, v, "causal", transport="dlpack")
    assert _compat.needs_materialization_each([out]) == [False]  # computed, not pending
    expected = torch_splash.attention(*(t.cpu() * 2 + 1 for t in base), "causal")
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert out.device.type == "xla"
