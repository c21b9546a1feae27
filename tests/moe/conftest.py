"""Every MoE test starts with no auxiliary-loss scale set: the scale is process-wide (Megatron-Core's
``MoEAuxLossAutoScaler`` keeps it on the class) and stays at what the last schedule call in this process set, so a
layer test after a pipeline test in the same process would otherwise scale its aux loss by ``1 / M``."""
import pytest

from engine.runtime.step import aux_loss_scale


@pytest.fixture(autouse=True)
def no_aux_loss_scale():
    aux_loss_scale.moe = aux_loss_scale.mtp = None
    yield
    aux_loss_scale.moe = aux_loss_scale.mtp = None
