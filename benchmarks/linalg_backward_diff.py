"""How far the replayed backward of torch.linalg's device-only forms is from eager's on CUDA
(tests/test_cuda_faults.py compares cholesky_ex, inv_ex and qr's to rounding only).
Usage: PYTHONPATH=src:tests python3 benchmarks/linalg_backward_diff.py"""

import torch
from test_backends_cpu import DEVICE_FORMS, Reads

import leangraph


def main() -> None:
    """Print each form's largest gradient differences from eager."""
    for name, then in DEVICE_FORMS.items():
        torch.manual_seed(0)
        module, eager = Reads(then).cuda(), Reads(then).cuda()
        eager.load_state_dict(module.state_dict())
        sample = torch.randn(4, 4, device="cuda", requires_grad=True)
        graphed = leangraph.make_graphed_callables(module, (sample,))
        x = torch.randn(4, 4, device="cuda", requires_grad=True)
        x_eager = x.detach().clone().requires_grad_(True)
        graphed(x).square().sum().backward()
        eager(x_eager).square().sum().backward()
        diff = (x.grad - x_eager.grad).abs().max().item()
        weight = (module.linear.weight.grad - eager.linear.weight.grad).abs().max().item()
        print(f"{name:12s} input grad max |diff| {diff:.3e}, weight grad max |diff| {weight:.3e}")
        leangraph.reset_all(graphed)


if __name__ == "__main__":
    main()
