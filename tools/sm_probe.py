"""How much slower does each benchmark workload train on a CUDA green context of N SMs?

The ``gpu2-hetero`` rig slows rank 1 by limiting its SMs; that only bites on compute-bound work.
This probe times plain PyTorch training steps (forward, backward, optimizer step; no Lightning)
of each candidate workload on the whole GPU and on a green context, and prints the ratio, so a
benchmark configuration can be chosen before spending a full run on it.

    python tools/sm_probe.py --sms 32 --steps 30
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_elche.bench.workloads import CHAR_SPECS, VOCAB, CharTransformer, throughput_net

Candidate = tuple[str, Callable[[], nn.Module], Callable[[torch.device], tuple[Tensor, Tensor]], str]


def image_batch(batch: int) -> Callable[[torch.device], tuple[Tensor, Tensor]]:
    return lambda device: (torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device))


def byte_batch(batch: int, seq_len: int) -> Callable[[torch.device], tuple[Tensor, Tensor]]:
    return lambda device: (torch.randint(0, VOCAB, (batch, seq_len), device=device),
                           torch.randint(0, VOCAB, (batch, seq_len), device=device))


def candidates() -> list[Candidate]:
    out: list[Candidate] = []
    for model in ("resnet20", "resnet20x4"):
        for batch in (256, 1024):
            out.append((f"{model} b{batch}", lambda m=model: throughput_net(m), image_batch(batch), "sgd"))
    for name in ("small", "medium"):
        spec = CHAR_SPECS[name]
        for batch in (64, 128):
            out.append((f"char-{name} b{batch}", lambda s=spec: CharTransformer(s), byte_batch(batch, spec.seq_len),
                        "adamw"))
    return out


def ms_per_step(net: nn.Module, batch: tuple[Tensor, Tensor], optimizer_name: str, steps: int,
                stream: torch.cuda.Stream) -> float:
    params = list(net.parameters())
    opt: torch.optim.Optimizer = (torch.optim.SGD(params, lr=0.01, momentum=0.9) if optimizer_name == "sgd"
                                  else torch.optim.AdamW(params, lr=1e-3))
    x, y = batch
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.default_stream())
        for i in range(steps + 5):
            if i == 5:
                stream.synchronize()
                t0 = time.perf_counter()
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        stream.synchronize()
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from torch.cuda.green_contexts import GreenContext

    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).multi_processor_count
    try:
        green = GreenContext.create(num_sms=args.sms, device_id=0)
    except TypeError:  # older signature: create(num_sms, device_id)
        green = GreenContext.create(args.sms, 0)
    limited = green.Stream()
    full = torch.cuda.Stream(device)
    print(f"{torch.cuda.get_device_name(device)}: {total} SMs vs a green context of {args.sms}")
    for name, make_net, make_batch, optimizer_name in candidates():
        torch.manual_seed(0)
        net = make_net().to(device)
        batch = make_batch(device)
        whole = ms_per_step(net, batch, optimizer_name, args.steps, full)
        part = ms_per_step(net, batch, optimizer_name, args.steps, limited)
        params = sum(p.numel() for p in net.parameters())
        print(f"{name:22s} {params / 1e6:6.2f} M params  {whole:8.2f} ms/step  {part:8.2f} ms/step on {args.sms} SMs"
              f"  slowdown {part / whole:5.2f}x  ({len(batch[0]) * 1000 / whole:,.0f} samples/s whole)", flush=True)
        del net, batch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
