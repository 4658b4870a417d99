"""A joiner's state over the group (lightning_elche.state_transfer): the tensors in one buffer, the
rest pickled; every kind of value a state holds arrives equal, in its container types."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from process_helpers import free_port


def _payload() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    module: OrderedDict[str, Any] = OrderedDict(
        weight=torch.randn(5, 3, generator=generator).t(),  # not contiguous
        half=torch.randn(7, generator=generator).half(),
        steps=torch.tensor(12),  # a scalar
        mask=torch.tensor([True, False, True]),
        empty=torch.zeros(0, 4),
        # From DIRECT_BYTES (1 MiB) on a tensor goes in a message of its own.
        large=torch.randn(600, 500, generator=generator).t(),  # 1.2 MB, not contiguous
        large_bf16=torch.randn(1024, 520, generator=generator).bfloat16(),  # 1.07 MB
    )
    module._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    return {"module": module, "optimizers": [{"state": {0: {"momentum_buffer": torch.arange(6.0).view(2, 3)}},
                                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "loop": {"epoch": 3}, "pair": (torch.ones(2, dtype=torch.int32), "text", None), "sparse": sparse}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and a.layout == b.layout
                and torch.equal(a.to_dense(), b.to_dense()))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from lightning_elche.state_transfer import recv_state, send_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            sent = send_state(_payload(), [1])
            Path(out, "sent.json").write_text(json.dumps(sent))
        else:
            # Targets in place for one direct and one packed tensor; a wrong shape and a missing key are ignored.
            targets = {"large": torch.empty(500, 600), "half": torch.empty(7).half(), "mask": torch.empty(4).bool()}
            addresses = {k: t.data_ptr() for k, t in targets.items()}
            received = recv_state(0, into={"module": targets, "nothing": [torch.empty(1)]})
            in_place = {k: received["module"][k].data_ptr() == addresses[k] for k in targets}
            report = {"same": _same(_payload(), received), "in_place": in_place,
                      "metadata": received["module"]._metadata == {"": {"version": 2}},
                      "own_storage": [received["module"][k].untyped_storage().nbytes() for k in ("weight", "large")]
                      == [15 * 4, 600 * 500 * 4]}
            Path(out, "received.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_state_arrives_equal_with_its_containers_metadata_and_a_sparse_tensor(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    received = json.loads((tmp_path / "received.json").read_text())
    assert received == {"same": True, "in_place": {"large": True, "half": True, "mask": False}, "metadata": True,
                        "own_storage": True}
    # The plain tensors' bytes (the sparse one is pickled): 15*4 + 7*2 + 8 + 3 + 0 + 6*4 + 2*4, and the large two.
    assert json.loads((tmp_path / "sent.json").read_text()) == 60 + 14 + 8 + 3 + 24 + 8 + 600 * 500 * 4 + 1024 * 520 * 2


@pytest.mark.parametrize("side", ["send", "receive"])
def test_a_message_refused_when_posted_reaches_the_transfer_s_wait(monkeypatch: pytest.MonkeyPatch, side: str) -> None:
    # gloo raises in isend/irecv itself once the other end closed its connection (a joiner killed
    # while rank 0 sends it its state): the error escaped the admission's watched wait and ended the
    # member's fit. It now reaches the wait, which judges it as a failed message (the peer is lost).
    from lightning_elche import state_transfer

    refused = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34196")

    def post(tensor: torch.Tensor, peer: int) -> Any:
        raise refused

    monkeypatch.setattr(state_transfer, "_transport_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(state_transfer.dist, "isend" if side == "send" else "irecv", post)
    waited: list[Any] = []

    def wait(work: Any) -> None:
        waited.append(work)
        work.wait()

    with pytest.raises(RuntimeError) as raised:
        if side == "send":
            state_transfer.pack_state({"x": torch.ones(3)}).send(1, wait)
        else:
            state_transfer.recv_state(0, wait=wait)
    assert raised.value is refused
    assert len(waited) == 1 and waited[0].is_completed()
