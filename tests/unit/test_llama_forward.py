"""The hf engine's own forward pass (libra/llama_forward.py) is transformers' Llama: the same logits
and KV cache on ragged, left-padded batches through prefill and decode steps (tied or untied output
head, grouped-query attention); it runs only where it is that model (`unsupported` names why not);
an engine on it samples what an engine on transformers samples; and a worker that uses it never
imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from libra.services.rollout.engines.hf_engine import HFEngine, Request  # noqa: E402
from libra.llama_forward import LlamaForward, unsupported, unsupported_dir  # noqa: E402

from tests.fixtures_model import make_random_llama  # noqa: E402


def _llama(tmp_path, tied: bool, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=tied, rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.2,
                         dtype="float32")
    torch.manual_seed(1)
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    return reference, LlamaForward.load(tmp_path)


def _reference(model, ids, mask, positions, cache):
    from transformers import DynamicCache

    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                past_key_values=DynamicCache(ddp_cache_data=cache) if cache else DynamicCache())
    layers = out.past_key_values.layers
    return out.logits[:, -1], [(layer.keys, layer.values) for layer in layers]


@pytest.mark.parametrize("tied, kv_heads", [(True, 4), (False, 4), (False, 2)])
def test_the_same_logits_and_cache_as_transformers(tmp_path, tied, kv_heads):
    reference, own = _llama(tmp_path, tied, kv_heads)
    assert (own.lm_head.weight is own.model.embed_tokens.weight) == tied
    assert set(own.state_dict()) == set(reference.state_dict())  # weight loads address it by the same names
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 19, 4, 12]
    width = max(lengths)
    ids = torch.randint(3, 97, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        expected, expected_cache = _reference(reference, ids, mask, positions, None)
        got, cache = own(ids, mask, positions)
        for step in range(4):  # decode steps on the cache each one returned
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            for (k, v), (ek, ev) in zip(cache, expected_cache):
                seen = mask.bool()[:, None, :, None].expand_as(k)  # padded columns hold nothing anyone reads
                assert torch.isfinite(k[seen]).all() and torch.isfinite(v[seen]).all()
                torch.testing.assert_close(k[seen], ek[seen], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v[seen], ev[seen], rtol=1e-5, atol=1e-5)
            last = torch.randint(3, 97, (len(lengths), 1), generator=generator)
            positions = mask.sum(1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            expected, expected_cache = _reference(reference, last, mask, positions, expected_cache)
            got, cache = own(last, mask, positions, cache)


def test_every_position_when_asked(tmp_path):
    reference, own = _llama(tmp_path, True, 4)
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        logits, _ = own(ids, mask, (mask.cumsum(1) - 1), last_only=False)
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


PLAIN = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
         "attention_bias": False, "mlp_bias": False, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}


@pytest.mark.parametrize("change, device, dtype, says", [
    ({}, "cuda:0", "float32", "device cuda:0"),
    ({}, "cpu", "bfloat16", "dtype bfloat16"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "cpu", "float32", "architecture"),
    ({"hidden_act": "gelu"}, "cpu", "float32", "activation gelu"),
    ({"attention_bias": True}, "cpu", "float32", "biases"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, "cpu", "float32", "rotary"),
    ({"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "cpu", "float32", "rotary"),
])
def test_anything_but_a_plain_float32_llama_on_cpu_goes_to_transformers(change, device, dtype, says):
    assert unsupported(PLAIN, "cpu", "float32") is None
    why = unsupported({**PLAIN, **change}, device, dtype)
    assert why is not None and says in why


def test_a_checkpoint_that_does_not_match_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = make_random_llama(tmp_path / "model", seed=0)
    state = load_file(str(directory / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaForward.load(directory)


def test_a_directory_runs_on_it_only_with_a_readable_config_and_safetensors(tmp_path):
    """The one check the engine and the trainer both make before loading a model directory."""
    from libra.services.trainer.config import TrainerConfig
    from libra.services.trainer.torch_backend import TorchBackend

    directory = make_random_llama(tmp_path / "model", seed=0)
    assert unsupported_dir(directory, "cpu", "float32") is None
    assert "float32" in unsupported_dir(directory, "cpu", "bfloat16")
    (directory / "model.safetensors").rename(directory / "weights.bin")  # the own pass reads safetensors only
    assert "no safetensors" in unsupported_dir(directory, "cpu", "float32")
    (directory / "config.json").unlink()
    assert "config.json unreadable" in unsupported_dir(directory, "cpu", "float32")
    backend = TorchBackend(TrainerConfig(torch_threads=1))
    assert "config.json unreadable" in backend._own_forward_reason(str(directory))  # the trainer asks the same


def _greedy(engine: HFEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    finished = threading.Semaphore(0)
    requests = [Request(p, 12, 0.0, 1.0, frozenset(), None, lambda r: finished.release()) for p in prompts]
    for request in requests:
        engine.submit(request)
    for _ in requests:
        assert finished.acquire(timeout=60)
    return [(r.generated, r.logprobs) for r in requests]


def test_an_engine_on_it_samples_what_an_engine_on_transformers_samples(tmp_path):
    directory = str(make_random_llama(tmp_path / "model", seed=0, tied=True))
    own, library = HFEngine(directory, prefill_ratio=0), HFEngine(directory, prefill_ratio=0, forward="transformers")
    try:
        assert (own.forward, library.forward) == ("own", "transformers")
        assert isinstance(own.model, LlamaForward)
        assert (own.eos_id, own.vocab_size) == (library.eos_id, library.vocab_size)
        prompts = [[5, 6, 7, 8, 9, 10, 11][:n] for n in (2, 7, 4, 1, 5)]
        for (tokens, logprobs), (expected, expected_logprobs) in zip(_greedy(own, prompts), _greedy(library, prompts)):
            assert tokens == expected
            assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)
    finally:
        own.stop()
        library.stop()
    with pytest.raises(ValueError, match="forward must be one of"):
        HFEngine(directory, forward="fast")


def test_a_worker_on_it_never_imports_transformers(tmp_path):
    from libra.model_config import ModelConfig
    from libra.tiny_model import create_tiny_model
    from libra.workloads.base import build_workload
    from libra.workloads.config import CalculatorConfig

    small = ModelConfig(hidden_size=32, layers=1, heads=2, kv_heads=2, intermediate_size=64, vocab_size=320,
                        max_position=128)
    directory = create_tiny_model(small, build_workload(CalculatorConfig()), tmp_path / "tiny", seed=0)
    code = ("import sys, json; from libra.services.rollout.engines.hf_server import load_tokenizer; "
            "from libra.services.rollout.engines.hf_engine import HFEngine; "
            f"t = load_tokenizer({str(directory)!r}); e = HFEngine({str(directory)!r}); "
            "ids = t('1 + 2', add_special_tokens=False).input_ids; "
            "print(json.dumps([e.forward, type(t).__name__, 'transformers' in sys.modules, t.decode(ids)])); e.stop()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["own", "LightTokenizer", False, "1 + 2"]

    from libra.services.rollout.engines.hf_server import load_tokenizer

    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chat = load_tokenizer(str(directory))  # chat needs transformers' tokenizer, which reads the template
    assert type(chat).__name__ != "LightTokenizer" and "m['content']" in chat.chat_template


def test_rows_finishing_in_one_step_wake_the_event_loop_once():
    import asyncio

    from libra.services.rollout.engines.hf_server import Settler

    async def main() -> tuple[int, list]:
        loop = asyncio.get_running_loop()
        wakes, original = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (wakes.append(args), original(*args))[1]
        settler, futures = Settler(), [loop.create_future() for _ in range(50)]
        step = threading.Thread(target=lambda: [settler.settle(loop, f, i) for i, f in enumerate(futures)])
        step.start()
        step.join()  # the whole step's rows finish while the loop is busy here
        results = await asyncio.wait_for(asyncio.gather(*futures), 10)
        later = loop.create_future()  # the next step's row wakes it again
        threading.Thread(target=settler.settle, args=(loop, later, "next")).start()
        results.append(await asyncio.wait_for(later, 10))
        return len(wakes), results

    wakes, results = asyncio.run(main())
    assert results == [*range(50), "next"]
    assert wakes == 2


def test_a_config_silent_on_tying_is_read_as_transformers_reads_it():
    from transformers import LlamaConfig

    config = {"vocab_size": 11, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "rms_norm_eps": 1e-6}
    own = LlamaForward(config)
    assert (own.lm_head.weight is own.model.embed_tokens.weight) == LlamaConfig(**config).tie_word_embeddings


def test_the_kv_cache_grows_in_place_and_never_under_another_view():
    """`_extend` (a decode step's cache append) is `torch.cat` along the positions, written in place
    after a buffer's last written position, and copied whenever writing in place could change what
    another view reads: a view extended a second time, a trimmed one, a fresh tensor."""
    from libra.llama_forward import KV_ROOM, _extend

    torch.manual_seed(0)
    base = torch.randn(2, 3, 5, 4)
    steps = [torch.randn(2, 3, 1, 4) for _ in range(KV_ROOM + 3)]
    cache, expected = base, base
    pointers = set()
    for step in steps:  # across the buffer's room: one copy when it is full
        cache, expected = _extend(cache, step), torch.cat([expected, step], dim=2)
        assert torch.equal(cache, expected)
        pointers.add(cache.data_ptr())
    assert len(pointers) == 2  # the first buffer, then one grown when its room ran out

    first = _extend(base, steps[0])
    second = _extend(first, steps[1])
    assert second.data_ptr() == first.data_ptr()  # in place
    kept = second.clone()
    other = _extend(first, steps[2])  # `first` extended again: must not overwrite `second`'s position
    assert torch.equal(other, torch.cat([first, steps[2]], dim=2)) and torch.equal(second, kept)
    assert other.data_ptr() != first.data_ptr()
    trimmed = second[:, :, 2:]  # the engine drops columns no row needs
    assert torch.equal(_extend(trimmed, steps[3]), torch.cat([trimmed, steps[3]], dim=2))
    assert torch.equal(second, kept)
    rows = second.index_select(0, torch.tensor([1]))  # finished rows leave
    assert torch.equal(_extend(rows, steps[4][1:]), torch.cat([rows, steps[4][1:]], dim=2))
