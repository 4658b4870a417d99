"""Models and data of the benchmark; nothing is downloaded.

* **Throughput**: a ResNet-20-like CNN (or an MLP, ``--model mlp``) on CIFAR-shaped synthetic
  images (3x32x32, 10 classes), generated from a seed directly on the rank's device and kept there,
  so the input pipeline cannot be the bottleneck.
* **Convergence on CPU**: scikit-learn's ``load_digits`` (1797 real 8x8 handwritten digits shipped
  with scikit-learn), a fixed 20 % held-out split, an MLP; quality = held-out accuracy.
* **Convergence on GPU**: a small byte-level ("character-level") transformer on the Python
  standard library's own ``*.py`` files (``os.path.dirname(os.__file__)``, sorted by name; every
  10th file is held out); quality = held-out loss in nats per byte.

Datasets hold their tensors on the device and implement ``__getitems__``, so that a batch is one
gather on the device rather than one small copy per sample; the DataLoader then uses
:func:`keep_batch` as its ``collate_fn``. Every class lives at module level (picklable).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
DIGITS_HELD_OUT = 0.2
SPLIT_SEED = 12345
HELD_OUT_FILE_EVERY = 10
CHAR_HELD_OUT_WINDOWS = 128
VOCAB = 256


def keep_batch(batch: Any) -> Any:
    """``collate_fn`` for datasets whose ``__getitems__`` already returns a whole batch."""
    return batch


class DeviceTensors(Dataset):
    """Aligned tensors on one device; ``transform`` turns gathered rows into a ``(x, y)`` batch.

    Args:
        tensors: tensors with the same first dimension, already on the target device.
        transform: maps the gathered rows (one tensor per input) to the batch.
    """

    def __init__(self, tensors: Sequence[Tensor], transform: Callable[..., tuple[Tensor, Tensor]]) -> None:
        self.tensors = list(tensors)
        self.transform = transform
        self.device = self.tensors[0].device

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def _index(self, indices: Sequence[int]) -> Tensor:
        index = torch.as_tensor(list(indices), dtype=torch.long)
        if self.device.type == "cuda":
            # Pinned and non-blocking: a pageable copy would synchronize the stream every batch.
            return index.pin_memory().to(self.device, non_blocking=True)
        return index

    def __getitems__(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        index = self._index(indices)
        return self.transform(*(t.index_select(0, index) for t in self.tensors))

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]


def normalize_images(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """uint8 images to float, roughly zero-mean and unit-variance."""
    return x.float().mul_(1.0 / 64.0).sub_(2.0), y


def identity_pair(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    return x, y


def shift_window(w: Tensor) -> tuple[Tensor, Tensor]:
    """A byte window of length T+1 to (input, next-byte target), both ``long``."""
    w = w.long()
    return w[:, :-1], w[:, 1:]


# -- throughput: synthetic CIFAR-shaped images -------------------------------------------------


def synthetic_images(num_samples: int, seed: int, device: torch.device) -> DeviceTensors:
    """``num_samples`` uint8 images = a per-class template plus noise, generated on ``device``.

    Deterministic in ``seed`` for a given device type; learnable (the class is in the template)
    but the benchmark only times it.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    templates = torch.randint(0, 128, (NUM_CLASSES, *IMAGE_SHAPE), generator=generator, device=device,
                              dtype=torch.uint8)
    labels = torch.randint(0, NUM_CLASSES, (num_samples,), generator=generator, device=device)
    noise = torch.randint(0, 128, (num_samples, *IMAGE_SHAPE), generator=generator, device=device, dtype=torch.uint8)
    images = templates.index_select(0, labels).add_(noise)
    return DeviceTensors([images, labels], normalize_images)


class BasicBlock(nn.Module):
    """ResNet basic block with a 1x1 projection shortcut when the shape changes."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet20(num_classes: int = NUM_CLASSES, base_width: int = 16) -> nn.Module:
    """ResNet-20 for 32x32 inputs (He et al. 2016, CIFAR variant): 3 stages x 3 blocks of
    ``base_width``/2x/4x channels (16/32/64 in the paper; 64 makes each convolution compute-bound
    on a large GPU, which an SM-limited throttle needs to bite)."""
    width = base_width
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    for out_ch, stride in ((base_width, 1), (2 * base_width, 2), (4 * base_width, 2)):
        for block in range(3):
            layers.append(BasicBlock(width, out_ch, stride if block == 0 else 1))
            width = out_ch
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    return nn.Sequential(*layers)


def mlp(in_features: int, hidden: int, depth: int, num_classes: int = NUM_CLASSES) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class Classifier(LightningModule):
    """Cross-entropy classifier trained with SGD + momentum; logs nothing (no per-step work)."""

    def __init__(self, net: nn.Module, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.momentum = momentum

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


# -- convergence on CPU: scikit-learn digits --------------------------------------------------


def digits_split(device: torch.device) -> tuple[DeviceTensors, tuple[Tensor, Tensor]]:
    """(train set, (held-out x, held-out y)): a fixed 80/20 split of ``load_digits``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_held = int(round(DIGITS_HELD_OUT * len(x)))
    held, train = order[:n_held], order[n_held:]
    train_set = DeviceTensors([x[train].to(device), y[train].to(device)], identity_pair)
    return train_set, (x[held].to(device), y[held].to(device))


# -- convergence on GPU: a byte-level transformer on the standard library -------------------


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name (a deterministic subset)."""
    root = Path(os.path.dirname(os.__file__))
    return sorted(p for p in root.glob("*.py") if p.is_file())


@dataclass(frozen=True)
class Corpus:
    train: bytes
    held_out: bytes
    files: int
    sha256: str


def stdlib_corpus(train_bytes: int, held_out_bytes: int) -> Corpus:
    """Train text from 9 files in 10, held-out text from every 10th, each truncated to its size."""
    train, held = bytearray(), bytearray()
    used = 0
    for i, path in enumerate(stdlib_files()):
        target, limit = (held, held_out_bytes) if i % HELD_OUT_FILE_EVERY == HELD_OUT_FILE_EVERY - 1 else (
            train, train_bytes)
        if len(target) >= limit:
            continue
        target += path.read_bytes()[: limit - len(target)]
        used += 1
        if len(train) >= train_bytes and len(held) >= held_out_bytes:
            break
    digest = hashlib.sha256(bytes(train) + b"\0" + bytes(held)).hexdigest()
    return Corpus(bytes(train), bytes(held), used, digest)


def byte_windows(text: bytes, seq_len: int, device: torch.device, limit: Optional[int] = None) -> Tensor:
    """Non-overlapping windows of ``seq_len + 1`` bytes, ``[n, seq_len + 1]`` uint8 on ``device``."""
    span = seq_len + 1
    n = len(text) // span
    if limit is not None:
        n = min(n, limit)
    if n < 1:
        raise ValueError(f"text of {len(text)} bytes holds no window of {span} bytes")
    flat = torch.frombuffer(bytearray(text[: n * span]), dtype=torch.uint8)
    return flat.view(n, span).to(device)


@dataclass(frozen=True)
class CharSpec:
    """Shape of the byte-level transformer."""

    d_model: int
    layers: int
    heads: int
    seq_len: int


CHAR_SPECS: dict[str, CharSpec] = {
    "tiny": CharSpec(d_model=64, layers=2, heads=2, seq_len=64),  # CPU
    "small": CharSpec(d_model=256, layers=4, heads=4, seq_len=256),
    "medium": CharSpec(d_model=512, layers=6, heads=8, seq_len=256),
}
CHAR_SPEC_GPU = CHAR_SPECS["small"]
CHAR_SPEC_CPU = CHAR_SPECS["tiny"]

IMAGE_MODELS = ("resnet20", "resnet20x4", "mlp", "mlp-wide")
CHAR_MODELS = tuple(f"char-{size}" for size in CHAR_SPECS)
THROUGHPUT_MODELS = IMAGE_MODELS + CHAR_MODELS
"""``resnet20x4``: ResNet-20 with 4x the channels (64/128/256); ``mlp-wide``: 3072-8192-5120-10,
67 M parameters (256 MB in f32), where parameter-sized buffers dominate the memory peak;
``char-<size>``: the byte-level transformer of the convergence section (AdamW), a sample being one
window of its text."""


def throughput_net(model: str) -> nn.Module:
    """The throughput section's network by name (:data:`THROUGHPUT_MODELS`)."""
    if model == "resnet20":
        return resnet20()
    if model == "resnet20x4":
        return resnet20(base_width=64)
    if model == "mlp":
        return mlp(math.prod(IMAGE_SHAPE), 512, 2)
    if model == "mlp-wide":
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(IMAGE_SHAPE), 8192), nn.ReLU(),
                             nn.Linear(8192, 5120), nn.ReLU(), nn.Linear(5120, NUM_CLASSES))
    raise ValueError(f"unknown throughput model {model!r}: expected one of {', '.join(THROUGHPUT_MODELS)}")


class CausalBlock(nn.Module):
    """Pre-LayerNorm transformer block with causal scaled-dot-product attention."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A small GPT-style byte-level language model."""

    def __init__(self, spec: CharSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, spec.d_model)
        self.pos = nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = nn.Sequential(*(CausalBlock(spec.d_model, spec.heads) for _ in range(spec.layers)))
        self.ln = nn.LayerNorm(spec.d_model)
        self.head = nn.Linear(spec.d_model, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        return self.head(self.ln(self.blocks(self.tok(x) + self.pos(positions))))


class LanguageModel(LightningModule):
    """Next-byte cross-entropy with AdamW (per-rank optimizer state under local SGD and ElChe)."""

    def __init__(self, spec: CharSpec, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        super().__init__()
        self.net = CharTransformer(spec)
        self.lr = lr
        self.weight_decay = weight_decay

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


# -- the workload objects the worker uses -----------------------------------------------------


class Workload:
    """A model factory, its training data and (for convergence) its held-out score.

    Attributes:
        name: short name for the report.
        quality: the key of the quality :meth:`evaluate` returns (``None``: no held-out score).
        higher_is_better: direction of ``quality``.
    """

    name = "workload"
    quality: Optional[str] = None
    higher_is_better = True

    def make_module(self) -> LightningModule:
        raise NotImplementedError

    def train_set(self, share: float = 1.0) -> DeviceTensors:
        """The training set; ``share`` < 1 keeps its first part (the solo fits of a throughput pass)."""
        raise NotImplementedError

    def evaluate(self, module: LightningModule) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "quality": self.quality, "higher_is_better": self.higher_is_better}


def _first(dataset: DeviceTensors, share: float) -> DeviceTensors:
    if share >= 1.0:
        return dataset
    n = max(1, int(len(dataset) * share))
    return DeviceTensors([t[:n] for t in dataset.tensors], dataset.transform)


class ImagesWorkload(Workload):
    """Synthetic CIFAR-shaped images and a ResNet-20 (or an MLP): throughput only."""

    def __init__(self, model: str, num_samples: int, device: torch.device, data_seed: int = 0) -> None:
        if model not in IMAGE_MODELS:
            raise ValueError(f"unknown image model {model!r}: expected one of {', '.join(IMAGE_MODELS)}")
        self.name = f"{model} on synthetic 3x32x32 images"
        self.model = model
        self.data = synthetic_images(num_samples, data_seed, device)

    def make_module(self) -> LightningModule:
        return Classifier(throughput_net(self.model), lr=0.05, momentum=0.9)

    def train_set(self, share: float = 1.0) -> DeviceTensors:
        return _first(self.data, share)


class DigitsWorkload(Workload):
    """scikit-learn digits, MLP 64-256-256-10, SGD; quality = held-out accuracy."""

    name = "MLP on scikit-learn digits (80/20 split)"
    quality = "held_out_acc"
    higher_is_better = True

    def __init__(self, device: torch.device) -> None:
        self.data, (self.held_x, self.held_y) = digits_split(device)

    def make_module(self) -> LightningModule:
        return Classifier(mlp(64, 256, 2), lr=0.05, momentum=0.9)

    def train_set(self, share: float = 1.0) -> DeviceTensors:
        return _first(self.data, share)

    @torch.no_grad()
    def evaluate(self, module: LightningModule) -> dict[str, float]:
        was_training = module.training
        module.eval()
        logits = module(self.held_x)
        loss = F.cross_entropy(logits, self.held_y)
        acc = (logits.argmax(dim=1) == self.held_y).float().mean()
        module.train(was_training)
        return {"held_out_acc": float(acc), "held_out_loss": float(loss)}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "train_samples": len(self.data), "held_out_samples": len(self.held_y)}


class CharWorkload(Workload):
    """Byte-level transformer on the standard library's sources; quality = held-out loss (nats/byte)."""

    quality = "held_out_loss"
    higher_is_better = False

    def __init__(self, spec: CharSpec, train_bytes: int, device: torch.device) -> None:
        self.spec = spec
        self.corpus = stdlib_corpus(train_bytes, CHAR_HELD_OUT_WINDOWS * (spec.seq_len + 1))
        self.name = f"byte-level transformer (d={spec.d_model}, {spec.layers} layers) on the stdlib sources"
        self.windows = byte_windows(self.corpus.train, spec.seq_len, device)
        self.held_out = byte_windows(self.corpus.held_out, spec.seq_len, device, limit=CHAR_HELD_OUT_WINDOWS)
        self.data = DeviceTensors([self.windows], shift_window)

    def make_module(self) -> LightningModule:
        return LanguageModel(self.spec)

    def train_set(self, share: float = 1.0) -> DeviceTensors:
        return _first(self.data, share)

    @torch.no_grad()
    def evaluate(self, module: LightningModule, batch: int = 64) -> dict[str, float]:
        was_training = module.training
        module.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.held_out.device)
        for start in range(0, len(self.held_out), batch):
            x, y = shift_window(self.held_out[start : start + batch])
            total += F.cross_entropy(module(x).reshape(-1, VOCAB), y.reshape(-1), reduction="sum").double()
        module.train(was_training)
        loss = float(total) / (len(self.held_out) * self.spec.seq_len)
        return {"held_out_loss": loss, "held_out_bits_per_byte": loss / math.log(2)}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "train_bytes": len(self.corpus.train),
            "held_out_windows": len(self.held_out),
            "files_read": self.corpus.files,
            "corpus_sha256": self.corpus.sha256,
            "seq_len": self.spec.seq_len,
            "d_model": self.spec.d_model,
            "layers": self.spec.layers,
        }


def throughput_workload(model: str, num_samples: int, device: torch.device) -> Workload:
    """The throughput section's workload: ``num_samples`` images, or windows of text for the
    transformer (``char-<size>``)."""
    if model in CHAR_MODELS:
        spec = CHAR_SPECS[model.removeprefix("char-")]
        return CharWorkload(spec, num_samples * (spec.seq_len + 1), device)
    return ImagesWorkload(model, num_samples, device)


def train_loader(dataset: Dataset, batch_size: int, drop_last: bool) -> DataLoader:
    """A plain shuffled DataLoader (each strategy installs its own sampler); batches gathered on device."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=drop_last, collate_fn=keep_batch,
                      num_workers=0)


def model_stats(module: nn.Module) -> dict[str, int]:
    """Sizes that the bytes-per-sample formulas need (docs/benchmarks.md)."""
    params = list(module.parameters())
    buffers = list(module.buffers())
    return {
        "param_numel": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in buffers),
        "float_buffer_bytes": sum(b.numel() * b.element_size() for b in buffers if b.is_floating_point()),
    }
