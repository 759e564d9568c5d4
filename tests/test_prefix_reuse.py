"""Follow-ups reuse their conversation's keys and values: the same answer as a fresh run, never another picture's."""
from __future__ import annotations

from engine import ChatRequest, Turn

from .conftest import engine_answer


def test_follow_up_reuses_the_conversation_and_matches_a_fresh_run(make_engine, images_dir):
    """Same answer with and without the prefix cache; with it, the image is not encoded again."""
    image = images_dir / "coffee.png"
    first_request = ChatRequest(prompt="Describe", images=(image,), max_new_tokens=6)

    def conversation(engine):
        first = engine.ask(first_request)
        follow_up = engine.ask(ChatRequest(prompt="What colour is the cup?", max_new_tokens=6, history=(
            Turn("user", "Describe", (image,)), Turn("assistant", first.text))))
        return first, follow_up

    cached_first, cached = conversation(make_engine())
    fresh_first, fresh = conversation(make_engine(prefix_cache_entries=0))
    assert cached.text == fresh.text and cached_first.text == fresh_first.text
    assert fresh.metrics.cached_prompt_tokens == 0 and "vision_encode" in fresh.metrics.stages
    assert "vision_encode" not in cached.metrics.stages
    assert cached.metrics.cached_prompt_tokens > cached_first.metrics.vision_tokens
    assert cached.metrics.prompt_tokens == fresh.metrics.prompt_tokens


def test_a_different_image_is_never_served_from_the_cache(engine, images_dir):
    """Same size, same tokens, other pixels: the placeholders match, the image must not."""
    from PIL import Image, ImageOps

    original = Image.open(images_dir / "coffee.png").convert("RGB")
    mirrored = ImageOps.mirror(original)
    first = engine.ask(ChatRequest(prompt="Describe", images=(original,), max_new_tokens=3))
    other = engine.ask(ChatRequest(prompt="Describe", images=(mirrored,), max_new_tokens=3))
    assert other.metrics.prompt_tokens == first.metrics.prompt_tokens
    assert "vision_encode" in other.metrics.stages
    assert other.metrics.cached_prompt_tokens < other.metrics.prompt_tokens - other.metrics.vision_tokens
    again = engine.ask(ChatRequest(prompt="Describe", images=(mirrored,), max_new_tokens=3))
    assert "vision_encode" not in again.metrics.stages and again.metrics.cached_prompt_tokens > 0


def test_interleaved_conversations_each_find_their_own_prefix(engine, images_dir):
    """Two sessions taking turns: the older entry (not the most recent) must be found and reused."""
    def first_turn(name):
        request = ChatRequest(prompt="Describe", images=(images_dir / name,), max_new_tokens=4)
        return request, engine.ask(request)

    coffee, coffee_answer = first_turn("coffee.png")
    cat, _ = first_turn("chelsea.png")
    follow_up = engine.ask(ChatRequest(prompt="More?", max_new_tokens=4, history=(
        Turn("user", "Describe", coffee.images), Turn("assistant", coffee_answer.text))))
    assert "vision_encode" not in follow_up.metrics.stages
    assert follow_up.metrics.cached_prompt_tokens >= coffee_answer.metrics.prompt_tokens


def test_follow_ups_from_the_prefix_cache_decode_in_a_batch_as_alone(make_engine, images_dir):
    """Two conversations' follow-up questions, each reusing its own cached picture and answer, decode together and
    give the answers they give alone (float32 greedy)."""
    engine = make_engine(max_batch=4, prefix_cache_entries=4)
    firsts = [ChatRequest(prompt="Describe", images=(images_dir / name,), max_new_tokens=8, ignore_eos=True)
              for name in ("coffee.png", "chelsea.png")]
    answers = [engine.ask(request) for request in firsts]
    follow_ups = [ChatRequest(prompt="And the colours?", max_new_tokens=12, ignore_eos=True,
                              history=(Turn("user", first.prompt, first.images), Turn("assistant", answer.text)))
                  for first, answer in zip(firsts, answers)]
    alone = [engine.ask(request) for request in follow_ups]
    assert all(a.metrics.cached_prompt_tokens > 0 for a in alone)
    handles = [engine.submit(request) for request in follow_ups]
    together = [engine_answer(handle) for handle in handles]
    for (text, metrics), reference in zip(together, alone):
        assert text == reference.text and metrics.cached_prompt_tokens > 0
    assert max(max(metrics.decode_batch_sizes) for _, metrics in together) == 2
