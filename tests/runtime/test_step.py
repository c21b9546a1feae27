"""The per-microbatch step functions: loss contract (Megatron's ``forward_step_calc_loss``; public cases B06, B07,
B08, B18, B20 of ``tests/runtime/test_public_bugs.py``), backward, output deallocation, the raw engine backward,
model hooks, shapes and the deferred embedding weight gradient."""
from __future__ import annotations

import pytest
import torch

from engine import parallel_state as ps
from engine.model_parallel_config import ModelParallelConfig
from engine.runtime.step import (ScheduleContractError, ScheduleContractTypeError, aux_loss_scale, backward_step,
                         clear_embedding_activation_buffer, custom_backward, deallocate_output_tensor,
                         finish_embedding_wgrad_compute, get_model_config,
                         get_tensor_shapes, is_pp_first_stage, is_pp_last_stage, is_vp_first_stage, is_vp_last_stage,
                         set_current_microbatch)
from engine.runtime.step import ChunkHooks
from engine.schedules import forward_step, forward_step_calc_loss


def calc(loss_func, *, M=4, cp=1, last=True, per_token=False, non_loss=False, config=None, output=None, store=None):
    config = config or ModelParallelConfig(calculate_per_token_loss=per_token)
    store = [] if store is None else store
    output = torch.tensor(2.0) if output is None else output
    out, n = forward_step_calc_loss(None, output, loss_func, config, None, non_loss, M, store, cp, last)
    return out, n, store


# ---- loss contract ------------------------------------------------------------------------------------------------

def test_two_tuple_scales_loss_in_place_by_cp_over_m():
    loss = torch.tensor(6.0, requires_grad=True) * 1  # non-leaf, like a real loss
    reduced = {"lm loss": loss}  # aliases the loss: Megatron's in-place normalisation shows through
    out, n, store = calc(lambda x: (loss, reduced), M=4, cp=2)
    assert out is loss and out.item() == pytest.approx(3.0)
    assert store == [reduced] and reduced["lm loss"].item() == pytest.approx(3.0)
    assert n.dtype == torch.int32 and n.item() == 0 and n.device.type == "cpu"


def test_two_tuple_ignores_per_token_flag_and_accepts_python_numbers():
    out, _, _ = calc(lambda x: (6.0, {}), M=4, cp=2, per_token=True)
    assert out == pytest.approx(3.0) and isinstance(out, float)


@pytest.mark.parametrize("n_tokens, want", [(3, 1.0), (0, 3.0)])  # 0 tokens: clamped to 1, no inf/NaN (B07)
def test_three_tuple_divides_by_tokens_then_m(n_tokens, want):
    n = torch.tensor(n_tokens, dtype=torch.int32)
    out, got_n, store = calc(lambda x: (torch.tensor(12.0), n, "r"), M=4)
    assert out.item() == pytest.approx(want) and torch.isfinite(out)
    assert got_n is n and store == ["r"]


def test_three_tuple_per_token_leaves_loss_and_returns_count():
    n = torch.tensor(3, dtype=torch.int32)
    out, got_n, _ = calc(lambda x: (torch.tensor(12.0), n, {}), M=4, cp=2, per_token=True)
    assert out.item() == 12.0 and got_n is n


def test_token_count_dtypes():
    """Integer tensors pass through unchanged; Python numbers and floating counts become int32 tensors
    (a floating count would otherwise break int32 accumulation in the schedule; B07 asks accept-or-reject)."""
    for given, want_dtype in [(torch.tensor(5, dtype=torch.int64), torch.int64), (5, torch.int32),
                              (torch.tensor(5.0), torch.int32), (5.0, torch.int32)]:
        out, n, _ = calc(lambda x, given=given: (torch.tensor(10.0), given, {}), M=1)
        assert n.dtype == want_dtype and n.item() == 5
        assert out.item() == pytest.approx(2.0)
    with pytest.raises(TypeError, match="token count"):
        calc(lambda x: (torch.tensor(1.0), "five", {}))


def test_loss_dtype_is_kept():
    """B18: the normalised loss keeps the loss function's dtype (no silent fp32/bf16 mix-up)."""
    out, _, _ = calc(lambda x: (torch.tensor(6.0, dtype=torch.bfloat16), {}), M=2)
    assert out.dtype == torch.bfloat16 and out.item() == 3.0


@pytest.mark.parametrize("bad", [(1.0,), (1.0, 2, 3, 4), torch.tensor(1.0)])
def test_loss_func_wrong_arity_is_a_contract_error(bad):
    with pytest.raises(ScheduleContractError) as err:
        calc(lambda x: bad)
    assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)


def test_collect_non_loss_data_and_loss_func_none():
    x = torch.tensor(5.0)
    out, n, store = calc(lambda o, non_loss_data=False: {"nl": non_loss_data, "o": o}, non_loss=True, output=x)
    assert out is x and store == [{"nl": True, "o": x}] and n.item() == 0
    out, _, store = calc(None, output=x)
    assert out is x and store == [x]


def test_non_last_stage_calls_nothing():
    called = []
    x = torch.tensor(5.0)
    out, n, store = calc(lambda o: called.append(o), last=False, output=x)
    assert out is x and store == [] and called == [] and n.item() == 0


def test_stage_and_cp_come_from_parallel_state_only_together():
    ps.destroy_model_parallel()
    x = torch.tensor(8.0)
    out, _ = forward_step_calc_loss(None, x, lambda o: (o * 1, {}), ModelParallelConfig(), None, False, 4, [])
    assert out.item() == 2.0  # single process: last stage, cp size 1
    for cp, last in [(1, None), (None, True)]:
        with pytest.raises(ScheduleContractError, match="both"):
            forward_step_calc_loss(None, x, None, ModelParallelConfig(), None, False, 4, [], cp, last)


def test_vp_stage_must_match_model():
    model = torch.nn.Linear(1, 1)
    model.vp_stage = 1
    with pytest.raises(ScheduleContractError, match="vp_stage"):
        forward_step_calc_loss(model, torch.tensor(1.0), None, ModelParallelConfig(), 0, False, 1, [], 1, True)
    forward_step_calc_loss(model, torch.tensor(1.0), None, ModelParallelConfig(), 1, False, 1, [], 1, True)


@pytest.mark.parametrize("per_token", [False, True])
def test_aux_loss_scales_on_every_stage(per_token):
    """B08: with MoE / MTP configured and grad_scale_func set, a non-last stage computes the aux-loss scales
    from its own output; no last-stage-only value is touched."""
    config = ModelParallelConfig(num_moe_experts=2, mtp_num_layers=1, grad_scale_func=lambda t: t * 4,
                                 calculate_per_token_loss=per_token)
    for last in (False, True):
        aux_loss_scale.moe = aux_loss_scale.mtp = None
        calc(lambda o: (o * 1, {}), M=4, cp=2, last=last, config=config, output=torch.ones(3, 2))
        assert aux_loss_scale.moe.item() == pytest.approx(4.0 if per_token else 4.0 * 2 / 4)
        assert aux_loss_scale.mtp.item() == pytest.approx(4.0 if per_token else 4.0 / 4)
    aux_loss_scale.moe = aux_loss_scale.mtp = None


# ---- end-to-end accumulation: one process, no pipelining ---------------------------------------------------------

class Affine(torch.nn.Module):
    """y = w * x (elementwise); first and last stage; reads its own data."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))

    def set_input_tensor(self, tensors):
        assert tensors == [None]

    def forward(self, x):
        return self.w * x


def run_microbatches(model, data, *, pattern, forward_only=False):
    """Forward + backward of every microbatch with forward_step / backward_step (the no-pipelining loop)."""
    config, store = model.config, []
    it = iter(data)

    def loss_func(batch, out):
        loss = (out * out).sum()
        if pattern == 2:
            return loss, {"loss": loss.detach()}
        return loss, (batch != 0).sum().to(torch.int32), {"loss": loss.detach()}  # masked tokens: zeros

    def step_func(data_iterator, m):
        batch = next(data_iterator)
        return m(batch), lambda out: loss_func(batch, out)

    tokens = torch.tensor(0, dtype=torch.int32)
    for mb in range(len(data)):
        out, n = forward_step(step_func, it, model, len(data), None, store, config, 1, current_microbatch=mb)
        tokens += n
        if not forward_only:
            backward_step(None, out, None, None, config)
    return store, tokens


def reference_grad(data, w, pattern):
    w = w.detach().clone().requires_grad_(True)
    total = 0
    for batch in data:
        loss = ((w * batch) ** 2).sum()
        total = total + (loss if pattern == 2 else loss / max(int((batch != 0).sum()), 1))
    (total / len(data)).backward()
    return w.grad


@pytest.mark.parametrize("pattern", [2, 3])
def test_grads_accumulate_over_calls_with_grad_scale_once_per_microbatch(pattern):
    """B06 / B07 / B20: the loss is normalised per microbatch in the forward step and scaled by
    grad_scale_func once per backward; .grad is never rescaled, so K calls give K x scale x mean-loss gradient,
    and every microbatch contributes (microbatch 3 is zeros)."""
    scale_calls = []

    def grad_scale(t):
        scale_calls.append(t.detach().clone())
        return t * 4

    model = Affine(ModelParallelConfig(grad_scale_func=grad_scale))
    data = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 4.0]), torch.tensor([2.0, 2.0, 2.0]),
            torch.zeros(3)]
    ref = reference_grad(data, model.w, pattern)
    for k in (1, 2, 3):
        store, _ = run_microbatches(model, data, pattern=pattern)
        assert len(store) == 4
        torch.testing.assert_close(model.w.grad, k * 4 * ref, rtol=1e-6, atol=0)
        assert len(scale_calls) == 4 * k
    assert reference_grad(data[3:], model.w, pattern).abs().sum() == 0  # "last microbatch only" would give 0
    assert model.w.grad.abs().sum() > 0


def test_per_token_total_and_forward_only():
    model = Affine(ModelParallelConfig(calculate_per_token_loss=True))
    data = [torch.ones(3), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 2.0])]
    store, tokens = run_microbatches(model, data, pattern=3, forward_only=True)
    assert tokens.item() == 6 and tokens.dtype == torch.int32
    assert model.w.grad is None and len(store) == 3


# ---- backward_step -----------------------------------------------------------------------------------------------

def test_backward_step_lists_and_both_signatures():
    config = ModelParallelConfig()
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    got = backward_step([x], [3 * x], [torch.tensor([1.0, 1.0])], None, config)
    assert isinstance(got, list) and got[0].tolist() == [3.0, 3.0]
    x2 = torch.tensor([1.0, 2.0], requires_grad=True)
    got = backward_step(x2, 3 * x2, torch.tensor([2.0, 0.0]), config)  # newer 4-argument form
    assert got.tolist() == [6.0, 0.0]


def test_backward_step_skips_outputs_without_grad_and_none_inputs():
    config = ModelParallelConfig(grad_scale_func=lambda t: t * 2)
    out = torch.tensor(3.0)  # requires no grad: backward silently skipped
    assert backward_step([None], out, None, None, config) == [None]


def test_backward_step_keeps_callers_list():
    config = ModelParallelConfig(grad_scale_func=lambda t: t * 2)
    x = torch.tensor([1.0], requires_grad=True)
    outputs = [(5 * x).sum()]
    first = outputs[0]
    backward_step(x, outputs, None, None, config)
    assert outputs[0] is first and x.grad.tolist() == [10.0]


def test_backward_step_timers():
    events = []

    class Timer:
        def __init__(self, name):
            self.name = name

        def start(self):
            events.append(("start", self.name))

        def stop(self):
            events.append(("stop", self.name))

    config = ModelParallelConfig(timers=lambda name, log_level=0: Timer(name))
    model = Affine(config)
    out, _ = forward_step(lambda it, m: (m(torch.ones(3)), lambda o: (o.sum(), {})), None, model, 1, None, [],
                          config, 1)
    backward_step(None, out, None, None, config)
    assert events == [("start", "forward-compute"), ("stop", "forward-compute"), ("start", "backward-compute"),
                      ("stop", "backward-compute")]


# ---- deallocation and the raw backward -----------------------------------------------------------------------------

def test_deallocate_keeps_autograd_node_and_custom_backward_matches_autograd():
    w = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 5, 4)
    grad = torch.randn(2, 5, 3)
    ref = torch.autograd.grad((x @ w), w, grad)[0]
    y = x @ w
    node = y.grad_fn
    deallocate_output_tensor(y, True)
    assert y.shape == (1,) and y.grad_fn is node and y.requires_grad
    with pytest.raises(RuntimeError):  # the public API refuses the shrunk output
        torch.autograd.backward(y, grad)
    custom_backward(y, grad)
    torch.testing.assert_close(w.grad, ref)


def test_custom_backward_scalar_default_ones_and_accumulation():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    custom_backward((3 * w).sum(), None)
    custom_backward((3 * w).sum(), None)
    assert w.grad.tolist() == [6.0, 6.0]


def test_custom_backward_type_errors():
    with pytest.raises(ScheduleContractTypeError):
        custom_backward([torch.ones(1)], None)
    with pytest.raises(ScheduleContractTypeError):
        custom_backward(torch.ones(1, requires_grad=True) * 1, [1.0])


def test_deallocate_noops_and_backward_step_with_deallocation():
    t = torch.ones(2, 2)
    deallocate_output_tensor(None, True)
    deallocate_output_tensor(t, False)
    assert t.shape == (2, 2)
    config = ModelParallelConfig(deallocate_pipeline_outputs=True)
    x = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(ScheduleContractError, match="pseudo-'freed'"):  # not deallocated, not a scalar
        backward_step(x, 2 * x, torch.ones(2, 2), None, config)


# ---- forward_step hooks --------------------------------------------------------------------------------------------

class Layer:
    current_microbatch = None


class Wrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_forward_step_hooks_through_wrappers():
    config = ModelParallelConfig()
    inner = torch.nn.Module()
    inner.config = config
    inner.decoder = torch.nn.Module()
    inner.decoder.layers = [Layer(), Layer()]
    inner.mtp = torch.nn.Module()
    mtp_layer = torch.nn.Module()
    mtp_layer.transformer_layer = Layer()
    inner.mtp.layers = [mtp_layer]
    received, first = [], []
    inner.set_input_tensor = received.append
    inner.set_is_first_microbatch = lambda: first.append("inner")  # not on the wrapper: not called
    model = Wrapper(inner)
    assert get_model_config(model) is config
    x = torch.ones(2)
    out, _ = forward_step(lambda it, m: (x * 2, None), None, model, 1, x, [], config, 1,
                          is_first_microbatch=True, current_microbatch=7, is_last_stage=False)
    assert received == [[x]] and first == [] and out.tolist() == [2.0, 2.0]
    assert [layer.current_microbatch for layer in inner.decoder.layers] == [7, 7]
    assert mtp_layer.transformer_layer.current_microbatch == 7
    model.set_is_first_microbatch = lambda: first.append("outer")
    forward_step(lambda it, m: (x, None), None, model, 1, x, [], config, 1, is_first_microbatch=True,
                 is_last_stage=False)
    assert first == ["outer"]
    set_current_microbatch(torch.nn.Linear(1, 1), 3)  # no decoder anywhere: nothing to do


def test_chunk_hooks_resolve_what_forward_step_looks_up_per_microbatch():
    """The executor resolves these once per schedule call; they must be what forward_step finds on its own."""
    inner = torch.nn.Module()
    inner.decoder = torch.nn.Module()
    inner.decoder.layers = [Layer(), Layer()]
    received = []
    inner.set_input_tensor = received.append
    model = Wrapper(inner)
    hooks = ChunkHooks(model)
    hooks.set_input_tensor([1])
    assert received == [[1]]
    assert hooks.set_is_first_microbatch is None  # only the chunk's own method counts, not the wrapped one
    assert hooks.microbatch_layers == inner.decoder.layers
    model.set_is_first_microbatch = lambda: None
    assert ChunkHooks(model).set_is_first_microbatch is model.set_is_first_microbatch
    assert ChunkHooks(Affine(ModelParallelConfig())).microbatch_layers == []
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        ChunkHooks(torch.nn.Linear(1, 1)).set_input_tensor  # noqa: B018 - the lookup itself raises


def test_forward_step_looks_up_layers_only_for_a_current_microbatch():
    """Megatron's order: nothing reads ``decoder.layers`` unless ``current_microbatch`` is given."""
    config = ModelParallelConfig()
    model = Affine(config)
    model.decoder = object()  # a decoder without .layers
    x = torch.ones(3)
    out, _ = forward_step(lambda it, m: (x * 2, None), None, model, 1, None, [], config, 1, is_last_stage=False)
    assert out.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(AttributeError):
        forward_step(lambda it, m: (x, None), None, model, 1, None, [], config, 1, current_microbatch=0,
                     is_last_stage=False)


@pytest.mark.parametrize("cp", [1, 2])
def test_two_value_loss_is_scaled_by_cp_over_m_in_place(cp):
    config = ModelParallelConfig()
    w = torch.tensor([3.0], requires_grad=True)
    raw = (w * 2).sum()
    store = []
    out, n = forward_step_calc_loss(None, raw, lambda o: (o, {"l": o.detach().clone()}), config, None, False, 4,
                                    store, cp_group_size=cp, is_last_stage=True)
    assert out is raw and out.item() == 6.0 * cp / 4 and n.dtype == torch.int32 and n.item() == 0
    out.backward()
    assert w.grad.item() == 2.0 * cp / 4 and store[0]["l"].item() == 6.0


def test_forward_step_errors():
    config = ModelParallelConfig()
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        forward_step(lambda it, m: (None, None), None, torch.nn.Linear(1, 1), 1, None, [], config, 1)
    model = Affine(config)
    with pytest.raises(TypeError, match=r"\(output, loss_func\)"):
        forward_step(lambda it, m: m(torch.ones(3)), None, model, 1, None, [], config, 1)
    with pytest.raises(RuntimeError, match="list"):
        get_model_config([model])


def test_forward_step_autocast():
    config = ModelParallelConfig(enable_autocast=True, autocast_dtype=torch.bfloat16)
    lin = torch.nn.Linear(4, 4)
    model = Affine(config)
    out, _ = forward_step(lambda it, m: (lin(torch.ones(2, 4)), None), None, model, 1, None, [], config, 1,
                          is_last_stage=False)
    assert out.dtype == torch.bfloat16


# ---- shapes, predicates, deferred embedding wgrad ----------------------------------------------------------------

def test_get_tensor_shapes_and_predicates():
    config = ModelParallelConfig(hidden_size=16)
    assert get_tensor_shapes(seq_length=32, micro_batch_size=2, decoder_seq_length=None, config=config,
                             tp_group=None, cp_group=None) == [(32, 2, 16)]
    assert get_tensor_shapes(seq_length=32, micro_batch_size=2, decoder_seq_length=8, config=config,
                             tp_group=None, cp_group=None) == [(8, 2, 16)]
    assert is_pp_first_stage(None) and is_pp_last_stage(None)
    assert is_vp_first_stage(None, None) and is_vp_last_stage(0, 1)
    assert is_vp_first_stage(0, 2) and not is_vp_last_stage(0, 2) and is_vp_last_stage(1, 2)
    with pytest.raises(ScheduleContractError):
        is_vp_first_stage(1, None)


class OutputStage(torch.nn.Module):
    def __init__(self, share):
        super().__init__()
        self.post_process = True
        self.share_embeddings_and_output_weights = share
        self.output_layer = torch.nn.Linear(4, 6, bias=False)
        self.embedding_activation_buffer = []
        self.grad_output_buffer = []

    def shared_embedding_or_output_weight(self):
        return self.output_layer.weight


@pytest.mark.parametrize("main_grad", [False, True])
def test_deferred_embedding_wgrad_equals_autograd(main_grad):
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                 defer_embedding_wgrad_compute=True, gradient_accumulation_fusion=True)
    stage = OutputStage(share=main_grad)
    weight = stage.output_layer.weight
    if main_grad:
        weight.main_grad = torch.zeros_like(weight)
    stage.embedding_activation_buffer.append(torch.zeros(1))
    assert clear_embedding_activation_buffer(config, [Wrapper(stage)], True) is stage
    assert stage.embedding_activation_buffer == []
    assert clear_embedding_activation_buffer(config, stage, False) is None
    acts = [torch.randn(3, 2, 4) for _ in range(2)]
    grads = [torch.randn(3, 2, 6) for _ in range(2)]
    ref = sum(torch.autograd.grad(torch.nn.functional.linear(a, weight), weight, g)[0] for a, g in zip(acts, grads))
    stage.embedding_activation_buffer.extend(acts)
    stage.grad_output_buffer.extend(grads)
    finish_embedding_wgrad_compute(config, stage, True, None)
    torch.testing.assert_close(weight.main_grad if main_grad else weight.grad, ref)
    assert stage.embedding_activation_buffer == [] and stage.grad_output_buffer == []
    stage.grad_output_buffer.append(grads[0])
    with pytest.raises(ValueError, match="buffered"):
        finish_embedding_wgrad_compute(config, stage, True, None)
