"""Megatron-Core 0.16.1 behaviour vectors for the per-microbatch functions (``tests/data/megatron_schedules.json``).

Each vector records arguments and the observed result of the real function; the test rebuilds the same call
(the vectors name the model output, the loss-function pattern and the stage) and compares tensors by value, dtype
and shape, stores entry by entry, and errors by type (pipecast's contract errors subclass ``AssertionError``).
"""
from __future__ import annotations

import re

import pytest
import torch

from engine import parallel_state as ps
from engine import schedules
from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.step import backward_step, check_first_val_step, custom_backward, deallocate_output_tensor
from engine.schedules import forward_step, forward_step_calc_loss, select_schedule_name
from tests.helpers.megatron_vectors import vector_params

ERRORS = {e.__name__: e for e in (TypeError, ValueError, RuntimeError, AssertionError, IndexError)}


def vectors(name):
    return pytest.mark.parametrize("vec", vector_params(name))


def encode(obj):
    """The vectors' serialisation: tensors as {tensor, dtype, shape}, containers recursively."""
    if isinstance(obj, torch.Tensor):
        return {"tensor": obj.detach().tolist(), "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


def assert_same(got, want, where="result"):
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {got!r} vs {want!r}"
        assert set(got) == set(want), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-6), f"{where}: {got!r} vs {want!r}"
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


# ---- check_first_val_step, get_forward_backward_func ------------------------------------------------------------

@vectors("check_first_val_step")
def test_check_first_val_step(vec):
    assert check_first_val_step(**vec["args"]) is vec["result"]


def _schedule_name_under(args, pick):
    state = args.get("_parallel_state")
    if state:
        ps.set_pipeline_model_parallel_world_size(state["pp"])
        ps.set_virtual_pipeline_model_parallel_world_size(state["vp"])
    try:
        return pick(args["pp_size"], args["vp_size"])
    finally:
        ps.destroy_model_parallel()


@vectors("get_forward_backward_func")
def test_select_schedule_name(vec):
    want = vec["result"]
    if isinstance(want, dict):
        with pytest.raises(ERRORS[want["error"]]):
            _schedule_name_under(vec["args"], select_schedule_name)
    else:
        assert _schedule_name_under(vec["args"], select_schedule_name) == want


@vectors("get_forward_backward_func")
def test_get_forward_backward_func(vec):
    func = schedules.get_forward_backward_func
    want = vec["result"]
    if isinstance(want, dict):
        with pytest.raises(ERRORS[want["error"]]):
            _schedule_name_under(vec["args"], lambda pp, vp: func(pp, vp))
    else:
        assert _schedule_name_under(vec["args"], lambda pp, vp: func(pp, vp).__name__) == want


# ---- forward_step_calc_loss -------------------------------------------------------------------------------------

def make_loss_func(kind, num_tokens, calls):
    """The loss functions the vectors describe: the loss is a new tensor, ``reduced`` holds the model output."""
    def loss_func(x, non_loss_data=False):
        if non_loss_data:
            calls.append("loss_func(x, non_loss_data=True)")
            return {"logits_sum": x * 10}
        calls.append("loss_func(x)")
        if kind == "2-tuple":
            return x * 1, {"lm loss": x}
        if kind == "3-tuple":
            return x * 1, torch.tensor(num_tokens, dtype=torch.int32), {"lm loss": x}
        raise AssertionError(kind)
    return None if kind == "none" else loss_func


@vectors("forward_step_calc_loss")
def test_forward_step_calc_loss(vec):
    a, want = vec["args"], vec["result"]
    calls, store = [], []
    config = ModelParallelConfig(calculate_per_token_loss=a["calculate_per_token_loss"])
    out, n = forward_step_calc_loss(
        None, torch.tensor(a["model_output"]), make_loss_func(a["loss_func_returns"], a["num_tokens_from_loss_func"],
                                                              calls),
        config, None, a["collect_non_loss_data"], a["num_microbatches"], store, a["cp_group_size"],
        a["is_last_stage"])
    assert_same(encode(out), want["returned_output_tensor"], "output")
    assert_same(encode(n), want["returned_num_tokens"], "num_tokens")
    assert_same(encode(store), want["forward_data_store"], "forward_data_store")
    assert calls == want["loss_func_calls"]


# ---- forward_step -------------------------------------------------------------------------------------------------

class RecordingChunk(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.got = []
        self.hooks = []

    def set_input_tensor(self, tensors):
        self.got.append(repr(tensors))

    def set_is_first_microbatch(self):
        self.hooks.append("set_is_first_microbatch")


@vectors("forward_step")
def test_forward_step(vec):
    a, want = vec["args"], vec["result"]
    model = RecordingChunk(ModelParallelConfig())
    calls, store = [], []

    def loss_func(o):
        return o * 1, {"loss": o}

    def forward_step_func(data_iterator, chunk, *extra):
        calls.append({"num_args": 2 + len(extra), "extra": extra[0] if extra else None,
                      "set_input_tensor_got": chunk.got[-1]})
        return torch.tensor(a.get("forward_step_func_output", 3.0)), loss_func

    input_tensor = [torch.tensor([0.0])] if a["input_tensor"] == "[tensor] (list)" else None
    out, n = forward_step(forward_step_func, iter(()), model, a.get("num_microbatches", 1), input_tensor, store,
                          model.config, a.get("cp_group_size", 1), collect_non_loss_data=False,
                          checkpoint_activations_microbatch=a.get("checkpoint_activations_microbatch"),
                          is_first_microbatch=a.get("is_first_microbatch", False),
                          is_last_stage=a["is_last_stage"])
    if "returned_type" in want:
        assert type(out).__name__ == want["returned_type"]
    assert_same(encode(out), want["returned"], "returned")
    assert_same(encode(n), want["num_tokens"], "num_tokens")
    assert_same(encode(store), want["forward_data_store"], "forward_data_store")
    assert calls == want["forward_step_func_calls"]
    if "model_hooks_called" in want:
        assert model.hooks == want["model_hooks_called"]


# ---- backward_step, deallocate_output_tensor, custom_backward ----------------------------------------------------

def _scale_func(spec):
    if spec is None:
        return None
    factor = float(re.fullmatch(r"x\*([0-9.]+)", spec).group(1))
    return lambda t: t * factor


@vectors("backward_step")
def test_backward_step(vec):
    a, want = vec["args"], vec["result"]
    config = ModelParallelConfig(deallocate_pipeline_outputs=a.get("deallocate_pipeline_outputs", False),
                                 grad_scale_func=_scale_func(a.get("grad_scale_func")))
    if "input" not in a:  # first + last stage: no input tensor, the loss depends on a parameter only
        w = torch.nn.Parameter(torch.tensor([1.0]))
        loss = (2 * w).sum()
        assert backward_step(None, loss, None, None, config) is None
        assert_same(encode(w.grad), want["param_grad"], "param_grad")
        return
    x = torch.tensor(a["input"], requires_grad=True)
    grad = None if a["output_tensor_grad"] is None else torch.tensor(a["output_tensor_grad"])
    y = 3 * x
    if grad is None:
        y = y.sum()
    elif config.deallocate_pipeline_outputs:
        deallocate_output_tensor(y, True)
        assert y.shape == (1,)
    got = backward_step(x, y, grad, None, config)
    assert_same(encode(got), want["input_tensor_grad"], "input_tensor_grad")


@vectors("deallocate_output_tensor")
def test_deallocate_output_tensor(vec):
    a, want = vec["args"], vec["result"]
    if "error" in want:
        base = torch.zeros(2, 3)
        arg = base[0] if a["tensor"] == "a view of another tensor" else [base]
        with pytest.raises(AssertionError) as err:
            deallocate_output_tensor(arg, a["deallocate_pipeline_outputs"])
        assert want["message"].rstrip(".") in str(err.value)
        return
    t = torch.zeros(*a["tensor_shape"])
    deallocate_output_tensor(t, False)
    assert list(t.shape) == want["shape_after_flag_false"]
    deallocate_output_tensor(t, True)
    assert list(t.shape) == want["shape_after_flag_true"]
    assert str(t.dtype) == want["dtype_preserved"]


@vectors("custom_backward")
def test_custom_backward(vec):
    want = vec["result"]
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(AssertionError) as err:
        custom_backward(x * 2, None)
    assert want["message"] in str(err.value)
