"""weights: colocated on one GPU: a trainer process exports versions through CUDA IPC handles and
the hf engine (this process) takes them, in both modes.

The exporter is a spawned process (a CUDA IPC handle cannot be opened by the process that made
it), holding a bf16 model of the engine's shape and writing version v as the model's weights + v.
share: the engine's parameters become views of the trainer's buffer v % 2 (no copy), and version
v + 1, written into the other buffer meanwhile, leaves what the engine serves untouched until it
takes v + 1. copy: one buffer, copied into the engine's own parameters. After each version the
engine's weights are exactly the exporter's, and it still generates.
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                         tie_word_embeddings=True, use_sliding_window=False)
    path = str(tmp_path_factory.mktemp("qwen2-colocated"))
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _exporter(model_dir: str, mode: str, requests, answers) -> None:
    """The trainer's side: version v = the model's weights + v, written on request."""
    from transformers import AutoModelForCausalLM

    from libra.weights.ipc import ColocatedExport

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
        base = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        export = None
        while (version := requests.get()) is not None:
            named = [(n, t + version) for n, t in base]
            export = export or ColocatedExport(named, mode, "cuda:0")
            descriptor = export.write(named, version)
            answers.put((descriptor, {n: float(t.double().sum()) for n, t in named}))
    except Exception as error:  # noqa: BLE001 - reported to the test
        answers.put((None, f"{type(error).__name__}: {error}"))


def _in_engine(engine, job):
    """Run `job` in the engine's decode thread, between two steps (as hf_server does)."""
    done, box = threading.Event(), {}

    def finished(result, error):
        box.update(result=result, error=error)
        done.set()

    engine.control(job, finished)
    assert done.wait(120), "the engine did not run the job"
    if box["error"] is not None:
        raise box["error"]
    return box["result"]


def _generate(engine) -> list[int]:
    from libra.services.rollout.engines.hf_engine import Request

    done, box = threading.Event(), {}
    engine.submit(Request([5, 6, 7, 8], 6, 0.0, 1.0, frozenset(), None, lambda r: (box.update(r=r), done.set())))
    assert done.wait(60)
    assert box["r"].error is None, box["r"].error
    return box["r"].generated


@pytest.mark.parametrize("mode", ["share", "copy"])
def test_versions_arrive_through_cuda_ipc(mode, model_dir):
    from libra.services.rollout.engines.hf_engine import HFEngine
    from libra.weights import ipc
    from libra.services.rollout.engines.hf_weights import _buffer_key

    context = multiprocessing.get_context("spawn")
    requests, answers = context.Queue(), context.Queue()
    exporter = context.Process(target=_exporter, args=(model_dir, mode, requests, answers), daemon=True)
    exporter.start()
    engine = HFEngine(model_dir, device="cuda:0", dtype="bfloat16", max_model_len=64, max_num_seqs=4)
    try:
        def sums() -> dict[str, float]:
            return {n: float(p.detach().double().sum()) for n, p in engine.model.named_parameters()}

        for version in (1, 2, 3):
            requests.put(version)
            descriptor, expected = answers.get(timeout=120)
            assert descriptor is not None, expected
            answer = _in_engine(engine, lambda: engine.receive_colocated(descriptor, version))
            assert answer.get("version") == version and answer["mode"] == mode, answer
            assert engine.version == version and sums() == expected
            assert len(_generate(engine)) == 6
            if mode == "share":  # the parameters live in the trainer's buffer of this version
                _, _, slot, layout, handles = ipc.parse(descriptor)
                base = engine._colocated_streams[_buffer_key(handles[slot])].data_ptr()
                offsets = {s.name: s.offset for s in layout.slots}
                assert all(p.data_ptr() == base + offsets[n] for n, p in engine.model.named_parameters())
                requests.put(version + 1)  # the next version, into the other buffer: what the engine serves stays
                answers.get(timeout=120)
                assert sums() == expected
        refused = _in_engine(engine, lambda: engine.receive_colocated(descriptor, 7))
        assert "not 7" in refused["error"] and engine.version == 3
    finally:
        requests.put(None)
        engine.stop()
        exporter.join(30)
