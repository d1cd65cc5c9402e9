"""Where a SemiFL silo step's time goes on a GPU: one silo update (600 images of 28 px, 2 local epochs in batches
of 32, full RandAugment: 38 steps) with torchvision's resnet18, timed after a warm-up update, then once more under
torch.profiler, whose tables (host time per op, kernel launches, host syncs) it prints.

    python bench/systems/gpu_step.py            # needs CUDA; about 15 s on an NVIDIA H200

The images are random pixels: the step's cost does not depend on what they show. bench/README.md ("Augmenting
where it is cheaper") has the figures from an H200 with the augmentations on the GPU and on the CPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from silo_core.algorithms.base import RoundPlan, SiloData, model_tensors  # noqa: E402
from silo_core.algorithms.semifl import SemiFLOptions, SemiFLSilo  # noqa: E402
from silo_core.models import ModelSpec  # noqa: E402

HOST_CALLS = ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "aten::item")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/systems/gpu_step.py needs a CUDA device; none is visible here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    images = torch.randint(0, 256, (600, 1, 28, 28), dtype=torch.uint8)
    spec = ModelSpec(name="torchvision/resnet18", num_classes=10, in_channels=1, image_size=28)
    plan = RoundPlan(round=1, tensors=model_tensors(spec.build()), hyperparameters={"lr": 0.03, "seed": 0},
                     expected={})
    silo = SemiFLSilo(SemiFLOptions(tau=0.0, local_epochs=2, silo_batch_size=32), spec, device)
    data = SiloData(images=images, silo_id="bench")
    silo.local_update(plan, data)  # warm-up: cuDNN's choices, the caching allocator
    torch.cuda.synchronize()
    started = time.time()
    steps = silo.local_update(plan, data).metrics["train_steps"]
    torch.cuda.synchronize()
    elapsed = time.time() - started
    print(f"one silo update, 600 images, 2 epochs: {elapsed:.2f}s, {steps:.0f} steps, "
          f"{1000 * elapsed / steps:.1f} ms/step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        silo.local_update(plan, data)
        torch.cuda.synchronize()
    ops = prof.key_averages()
    print(ops.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(ops.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    for name in HOST_CALLS:
        for row in (r for r in ops if r.key == name):
            print(f"{name}: {row.count} calls, {row.cpu_time_total / 1000:.1f} ms host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
