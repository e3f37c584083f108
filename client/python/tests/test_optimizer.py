"""Client.optimizer_step against torch.optim (float64) on the same gradients,
and the optimizer state's rules as the Python client sees them."""

from __future__ import annotations

import numpy as np
import pytest

from mhc_client import errors


def _backward(client, name, rng):
    """Adds one backward pass's gradients to layer `name` (n=4, C=8)."""
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    y, _, h_post, h_res = client.pre(name, x)
    pb = client.post_backward(name, x, y, x, h_post, h_res, skip_dx=True)
    client.pre_backward(name, x, y, pb.dh_post, pb.dh_res, dx_next=x)


@pytest.mark.parametrize("algorithm", ["sgd", "adamw"])
def test_matches_torch_optimizer_with_clipping(client, layer_name, rng,
                                               algorithm):
    torch = pytest.importorskip("torch")
    names = [layer_name, layer_name + "-b"]
    for i, name in enumerate(names):
        client.create_layer(name, 8, n=4, seed=3 + i)
    try:
        _compare_with_torch(torch, client, names, rng, algorithm)
    finally:
        client.delete_layer(names[1])


def _compare_with_torch(torch, client, names, rng, algorithm):
    params = {}
    for name in names:
        for key, value in client.get_parameters(name).items():
            params[(name, key)] = torch.tensor(value.astype(np.float64),
                                               requires_grad=True)
    ordered = list(params.values())
    if algorithm == "sgd":
        reference = torch.optim.SGD(ordered, lr=0.05, momentum=0.9,
                                    nesterov=True, weight_decay=0.01)
        options = dict(algorithm="sgd", learning_rate=0.05, momentum=0.9,
                       nesterov=True, weight_decay=0.01)
    else:
        reference = torch.optim.AdamW(ordered, lr=0.01, betas=(0.8, 0.99),
                                      eps=1e-6, weight_decay=0.1)
        options = dict(algorithm="adamw", learning_rate=0.01,
                       betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for step in range(1, 4):
        for name in names:
            _backward(client, name, rng)
            for key, grad in client.get_gradients(name).items():
                params[(name, key)].grad = torch.tensor(
                    grad.astype(np.float64))
        norm = torch.nn.utils.clip_grad_norm_(ordered, max_norm=0.5)
        reference.step()
        result = client.optimizer_step(names, max_grad_norm=0.5,
                                       zero_gradients=True, **options)
        assert result.grad_norm == pytest.approx(float(norm), rel=1e-9)
        assert result.clip_coefficient < 1.0
        assert [info.optimizer_step for info in result.layers] == [step] * 2
        assert {info.optimizer_algorithm for info in result.layers} == {
            algorithm}
        for name in names:
            for key, value in client.get_parameters(name).items():
                want = params[(name, key)].detach().numpy()
                np.testing.assert_allclose(value, want, rtol=2e-6, atol=2e-6,
                                           err_msg=f"{name}.{key} step {step}")
            assert client.get_gradients(name).tokens == 0


def test_state_rules_and_errors(client, layer_name, rng):
    info = client.create_layer(layer_name, 8, n=4, seed=1)
    assert info.optimizer_algorithm == "" and info.optimizer_step == 0
    _backward(client, layer_name, rng)
    result = client.optimizer_step(layer_name, algorithm="sgd",
                                   learning_rate=0.1, compute_grad_norm=True)
    assert result.grad_norm > 0 and result.clip_coefficient == 1.0
    after = result.layers[0]
    assert after.parameters_version == info.parameters_version + 1
    assert after.gradient_tokens == 3  # kept without zero_gradients

    before = client.get_parameters(layer_name)
    with pytest.raises(errors.FailedPrecondition, match="reset_state"):
        client.optimizer_step(layer_name, learning_rate=0.1)
    for key, value in client.get_parameters(layer_name).items():
        np.testing.assert_array_equal(value, before[key])
    reset = client.optimizer_step(layer_name, learning_rate=0.1,
                                  reset_state=True)
    assert reset.layers[0].optimizer_algorithm == "adamw"
    assert reset.layers[0].optimizer_step == 1

    with pytest.raises(errors.InvalidArgument, match="learning_rate"):
        client.optimizer_step(layer_name, learning_rate=-1.0)
    with pytest.raises(errors.InvalidArgument, match="adamw.beta2"):
        client.optimizer_step(layer_name, learning_rate=0.1,
                              betas=(0.9, 1.0))
    with pytest.raises(errors.InvalidArgument, match=r"layers\[1\]"):
        client.optimizer_step([layer_name, layer_name], learning_rate=0.1)
    with pytest.raises(errors.NotFound):
        client.optimizer_step("no-such-layer", learning_rate=0.1)
    with pytest.raises(ValueError):
        client.optimizer_step(layer_name, algorithm="lion",
                              learning_rate=0.1)
    assert client.get_layer(layer_name).optimizer_step == 1
