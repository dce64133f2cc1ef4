"""FusedAdam against torch.optim.AdamW / torch.optim.Adam and against ONNX Runtime Training's formulas."""

import io
import math

import pytest
import torch

from onnxtrain.optim import AdamWMode, FusedAdam


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(8, 4, generator=g)
    xs = [torch.randn(5, 8, generator=g) for _ in range(steps)]
    return [(x, x @ target) for x in xs]


def _train(model, optimizer, batches, scheduler=None):
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def _groups(model, lrs=(1e-2, 3e-3), wds=(0.1, 0.0)):
    first, second = list(model[0].parameters()), list(model[2].parameters())
    return [
        {"params": first, "lr": lrs[0], "weight_decay": wds[0]},
        {"params": second, "lr": lrs[1], "weight_decay": wds[1]},
    ]


def _assert_same_params(a, b, atol):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb.to(pa.dtype), atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


class _ReferenceAdam:
    """ONNX Runtime Training's multi_tensor_adam kernel, one parameter at a time in float64."""

    def __init__(self, params, lr, betas, eps, weight_decay, mode, bias_correction=True):
        self.params = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0
        self.lr, self.betas, self.eps, self.wd, self.mode = lr, betas, eps, weight_decay, mode
        self.bias_correction = bias_correction

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = (1 - b1**self.t, 1 - b2**self.t) if self.bias_correction else (1.0, 1.0)
        for i, g in enumerate(grads):
            p, g = self.params[i], g.double()
            if self.mode == AdamWMode.ADAMW_TORCH:
                p = p * (1 - self.lr * self.wd)
            if self.mode == AdamWMode.ADAM_L2_REGULARIZATION:
                g = g + self.wd * p
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            if self.mode == AdamWMode.ADAMW_TORCH:
                p = p - self.lr / bc1 * self.m[i] / (self.v[i].sqrt() / math.sqrt(bc2) + self.eps)
            else:
                p = p - self.lr * math.sqrt(bc2) / bc1 * self.m[i] / (self.v[i].sqrt() + self.eps)
            if self.mode == AdamWMode.ADAMW_TRANSFORMERS:
                p = p - self.lr * self.wd * p
            self.params[i] = p


def test_adamw_torch_matches_torch_adamw_with_param_groups():
    batches = _batches(60)
    ours, ref = _model(), _model()
    opt = FusedAdam(_groups(ours), lr=1e-3, eps=1e-8, adam_w_mode=AdamWMode.ADAMW_TORCH)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3, eps=1e-8, foreach=False)
    losses, ref_losses = _train(ours, opt, batches), _train(ref, ref_opt, batches)
    torch.testing.assert_close(losses, ref_losses, atol=1e-6, rtol=1e-5)
    _assert_same_params(ours, ref, atol=1e-6)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    # The weight-decayed group moved differently from the undecayed one: groups were not merged.
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0


def test_default_mode_is_adamw_torch():
    assert FusedAdam(_model().parameters()).adam_w_mode is AdamWMode.ADAMW_TORCH


def test_adam_l2_matches_torch_adam_when_eps_is_zero():
    # With eps = 0 the two Adam denominators coincide, so torch.optim.Adam (L2 penalty) is an exact reference.
    batches = _batches(40)
    ours, ref = _model(), _model()
    opt = FusedAdam(_groups(ours), eps=0.0, adam_w_mode=AdamWMode.ADAM_L2_REGULARIZATION)
    ref_opt = torch.optim.Adam(_groups(ref), eps=0.0, foreach=False)
    torch.testing.assert_close(_train(ours, opt, batches), _train(ref, ref_opt, batches), atol=1e-5, rtol=1e-5)
    _assert_same_params(ours, ref, atol=1e-5)


@pytest.mark.parametrize("mode", list(AdamWMode))
@pytest.mark.parametrize("bias_correction", [True, False])
def test_modes_follow_reference_formulas_over_many_steps(mode, bias_correction):
    torch.manual_seed(0)
    params = [torch.randn(7, 3, requires_grad=True), torch.randn(11, requires_grad=True), torch.randn(2, 2, 2, requires_grad=True)]
    kwargs = dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    ref = _ReferenceAdam(params, mode=mode, bias_correction=bias_correction, **kwargs)
    opt = FusedAdam(params, adam_w_mode=mode, bias_correction=bias_correction, **kwargs)
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        ref.step(grads)
    for p, r in zip(params, ref.params):
        torch.testing.assert_close(p.detach().double(), r, atol=2e-5, rtol=1e-5)


def test_state_dict_round_trip_resumes_the_same_trajectory():
    batches = _batches(20)
    straight = _model()
    straight_opt = FusedAdam(_groups(straight), weight_decay=0.01)
    _train(straight, straight_opt, batches)

    first = _model()
    first_opt = FusedAdam(_groups(first), weight_decay=0.01)
    _train(first, first_opt, batches[:10])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # what transformers.Trainer does when resuming

    resumed = _model(seed=123)  # different initial weights, overwritten by the checkpoint
    resumed.load_state_dict(saved["model"])
    resumed_opt = FusedAdam(_groups(resumed, lrs=(9.0, 9.0)), weight_decay=0.01)  # lrs come from the checkpoint
    resumed_opt.load_state_dict(saved["optim"])
    assert resumed_opt.param_groups[0]["lr"] == 1e-2
    assert all(s["step"] == 10 for s in resumed_opt.state.values())
    _train(resumed, resumed_opt, batches[10:])
    _assert_same_params(resumed, straight, atol=0)


def test_none_grads_are_skipped_like_torch_adamw():
    # The second parameter gets a gradient on odd steps only; its step count (and so its bias correction)
    # must advance only when it is updated, as in torch.optim.AdamW.
    torch.manual_seed(0)
    ours = [torch.randn(4, requires_grad=True), torch.randn(3, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdam(ours, lr=1e-2, eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, eps=1e-8, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(3)
    for step in range(12):
        grads = [torch.randn(4, generator=g), torch.randn(3, generator=g) if step % 2 else None]
        for params in (ours, ref):
            for p, grad in zip(params, grads):
                p.grad = None if grad is None else grad.clone()
        opt.step()
        ref_opt.step()
        if step == 0:
            assert ours[1] not in opt.state  # no state for a parameter that never had a gradient
            torch.testing.assert_close(ours[1], ref[1], atol=0, rtol=0)
    assert opt.state[ours[0]]["step"] == 12 and opt.state[ours[1]]["step"] == 6
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-6)


def test_sparse_gradients_are_rejected_with_advice():
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = FusedAdam(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient.*SparseAdam"):
        opt.step()


def test_zero_grad_honours_set_grad_none():
    model = _model()
    x, y = _batches(1)[0]
    for set_grad_none, expect_none in ((True, True), (False, False)):
        opt = FusedAdam(model.parameters(), set_grad_none=set_grad_none)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.zero_grad()
        for p in model.parameters():
            assert (p.grad is None) == expect_none
            if not expect_none:
                assert torch.count_nonzero(p.grad) == 0
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_works_with_lr_scheduler_like_torch_adamw():
    batches = _batches(15)
    ours, ref = _model(), _model()
    opt = FusedAdam(ours.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.01)
    def decay(step):
        return 1.0 - step / 15

    _train(ours, opt, batches, torch.optim.lr_scheduler.LambdaLR(opt, decay))
    _train(ref, ref_opt, batches, torch.optim.lr_scheduler.LambdaLR(ref_opt, decay))
    _assert_same_params(ours, ref, atol=1e-6)


def test_closure_returns_loss():
    model = _model()
    x, y = _batches(1)[0]
    opt = FusedAdam(model.parameters())

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(x), y).item()
    loss = opt.step(closure)
    assert loss.item() == expected
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "invalid learning rate"),
        (dict(eps=-1e-8), "invalid eps"),
        (dict(weight_decay=-0.1), "invalid weight_decay"),
        (dict(betas=(0.9, 1.0)), "invalid betas"),
        (dict(adam_w_mode=7), "unknown adam_w_mode 7; use one of AdamWMode.ADAM_L2_REGULARIZATION"),
    ],
)
def test_invalid_hyperparameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedAdam(_model().parameters(), **kwargs)


def test_invalid_group_override_is_named():
    model = _model()
    with pytest.raises(ValueError, match="parameter group 1: invalid learning rate"):
        FusedAdam([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": -1}])
