"""Private torch attributes are reached only through torch_compat, which names the torch version and
the way out when one is missing."""
import types

import pytest
import torch
from torch import nn

from bytecheckpoint.common import torch_compat
from bytecheckpoint.common.torch_compat import TorchCompatError


def test_missing_fsdp1_internals_name_version_and_fix():
    with pytest.raises(TorchCompatError) as err:
        torch_compat.fsdp1_handle(nn.Linear(2, 2))
    assert torch.__version__ in str(err.value) and "Linear._handle" in str(err.value)
    assert "fsdp1_route='sharded_tensor'" in str(err.value)
    flat = types.SimpleNamespace(_fqns=("w",), _shapes=((2, 2),))  # no _contiguities
    with pytest.raises(TorchCompatError, match=r"_contiguities.*tested with torch 2\.11 to 2\.15"):
        torch_compat.flat_param_info(types.SimpleNamespace(flat_param=flat))


def test_flat_param_info_reads_fsdp_bookkeeping():
    info = types.SimpleNamespace(in_shard=True, offset_in_shard=3, numel_in_shard=5, intra_param_start_idx=7,
                                 intra_param_end_idx=11)
    out = types.SimpleNamespace(in_shard=False, offset_in_shard=None, numel_in_shard=None,
                                intra_param_start_idx=None, intra_param_end_idx=None)
    tied = types.SimpleNamespace(param_name="weight", module_name="head", prim_param_name="weight",
                                 prim_module_name="emb")
    flat = types.SimpleNamespace(_fqns=("a.w", "b"), _shapes=(torch.Size([3, 4]), torch.Size([2])),
                                 _contiguities=(True, True), _shard_param_infos=(info, out),
                                 _shared_param_infos=(tied,), _sharded_size=torch.Size([8]), shape=torch.Size([8]))
    got = torch_compat.flat_param_info(types.SimpleNamespace(flat_param=flat, uses_sharded_strategy=True))
    assert got.fqns == ("a.w", "b") and got.shapes == ((3, 4), (2,))
    assert got.shards[0] == (True, 3, 5, 7) and not got.shards[1].in_shard
    assert got.aliases == (("head.weight", "emb.weight"),) and got.local_now


def test_clean_fqn_drops_wrapper_prefixes():
    assert torch_compat.clean_fqn("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.up.weight") == "blocks.0.up.weight"
    assert torch_compat.clean_fqn("_checkpoint_wrapped_module.w") == "w"
