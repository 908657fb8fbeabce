"""V4.1's vision tower: the image processor's grid and patches, the tower and its segment in
the prompt, the router's image bias, Engram skipping image positions, the checkpoint's
vision tensors, and the plan's figures for a picture."""

import base64
import hashlib
import io
import json
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kvstack.cache.reference import ReferenceStore
from kvstack.config import ModelConfig, preset
from kvstack.engine.images import (
    ImageError,
    expand_images,
    image_input,
    read_image_bytes,
)
from kvstack.image_grid import plan_grid, segment_length
from kvstack.model import Model
from kvstack.model.checkpoint import export_v41
from kvstack.model.params import count_parameters, vision_parameter_shapes
from kvstack.model.vision import IMAGE, ImageInput, ImageSegment, segment_rows, segment_types
from kvstack.plan import make_plan
from tests.v41_checkpoint import hf_config, inference_config, write_v41_checkpoint

PIL = pytest.importorskip("PIL.Image")
SEED = 0
# DeepSeek's V4.1 code (its model.py, vision.py and image_processor.py, with the CPU ports of
# its kernels) run on the tiny-v41-vision checkpoint tests/v41_checkpoint.py writes with
# seed 0, and its image processor on a set of sizes: data/README.md.
REFERENCE = Path(__file__).parent / "data" / "vision_reference.safetensors"


@pytest.fixture(scope="module")
def seeing(tmp_path_factory) -> Model:
    directory = tmp_path_factory.mktemp("vision")
    write_v41_checkpoint(directory, preset("tiny-v41-vision"), seed=SEED, shards=2)
    return Model.from_pretrained(directory).eval()


def png(width: int, height: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    PIL.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def prompt_with(model: Model, images: list[ImageInput], text: int = 6,
                seed: int = 1) -> tuple[torch.Tensor, list[ImageSegment]]:
    """text tokens, then each image's placeholder followed by text tokens."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in images:
        ids += [*torch.randint(0, 500, (text,), generator=g).tolist(), c.image_token_id]
    ids += torch.randint(0, 500, (text,), generator=g).tolist()
    expanded, segments = expand_images(ids, images, c)
    return torch.tensor([expanded]), segments


def reference() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(REFERENCE), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def test_with_images_the_logits_equal_deepseeks_within_its_own_noise_floor(seeing):
    """Every prompt position's logits and four decode steps after it, the prompt holding two
    images, against DeepSeek's code: within twice what the reference itself moves when
    every input value (token embeddings and pixels) moves by one bf16 ulp; the tower's rows
    within twice their own floor; the greedy token wherever the reference's two best
    logits stand further apart than that."""
    ref, _ = reference()
    model, c = seeing, seeing.config
    images = [image_input(png(100, 70, 1), c), image_input(png(60, 120, 2), c)]
    segments = [ImageSegment(int(ref[f"image_start_{i}"]), image) for i, image in enumerate(images)]
    ids = ref["tokens"][None]
    assert ids[0].tolist() == expand_images(
        [t for i, t in enumerate(ids[0].tolist())
         if t != c.image_token_id or i in {s.start for s in segments}], images, c)[0]
    with torch.no_grad():
        for i, image in enumerate(images):
            rows = segment_rows(model, image)[segment_types(*image.grid) == IMAGE]
            floor = ref["floor_image_embeds"][i]
            assert (rows - ref[f"image_embeds_{i}"]).abs().max() <= 2 * floor
        prefill = model(ids, images=segments).logits[0]  # [n, V]
        store = ReferenceStore(c, 1, ids.device)
        model.prefill(ids, store, replay="exact", images=segments)
        decoded = torch.stack([model.decode(torch.tensor([t]), store)[0]
                               for t in ref["decode_tokens"].tolist()])
    got = torch.cat([prefill, decoded])
    want = torch.cat([ref["prefill_logits"], ref["decode_logits"]])
    floor = torch.cat([ref["floor_prefill"], ref["floor_decode"]])
    assert ((got - want).abs().amax(-1) <= 2 * floor).all()
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * floor
    assert clear.sum() >= 3
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_the_image_processor_equals_deepseeks():
    """The grid of 18 sizes (tiny, huge, extreme aspects) on V4.1-Flash's settings, the tiny
    preset's and the tiny preset's with a width limit (which stretches instead of padding);
    the patches, byte for byte, of 10 pictures on the last two."""
    ref, digests = reference()
    flash, tiny = preset("deepseek-v4.1-flash"), preset("tiny-v41-vision")
    configs = {"flash": flash, "tiny": tiny, "tiny_wide": tiny.replace(vision_max_wh_ratio=2)}
    for name, c in configs.items():
        for (width, height), want in zip(ref["sizes"].tolist(), ref[f"plan_{name}"].tolist(),
                                         strict=True):
            grid = plan_grid(width, height, c)
            assert [grid.n_h, grid.n_w, grid.height, grid.width] == want, (name, width, height)
    for name in ("tiny", "tiny_wide"):
        for k, (width, height) in enumerate(ref["patch_sizes"].tolist()):
            got = image_input(png(width, height, 10 + k), configs[name])
            n_h, n_w = got.grid
            assert [got.n_vit_h, got.n_vit_w, n_h, n_w] == ref[f"grid_{name}_{k}"].tolist()
            data = got.patches.contiguous().view(torch.uint8).numpy().tobytes()
            assert hashlib.sha256(data).hexdigest() == digests[f"sha256_patches_{name}_{k}"]


def test_the_span_is_start_rows_of_tokens_and_newlines_then_end():
    assert segment_length(2, 3) == 10
    assert segment_types(2, 3).tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]


def test_the_image_grid_fits_the_token_budget_and_keeps_small_images_whole():
    c = preset("deepseek-v4.1-flash")
    for width, height in [(1, 1), (544, 544), (4000, 3000), (3000, 4000), (20000, 20),
                          (20, 20000), (1024, 768), (14, 14 * 500)]:
        grid = plan_grid(width, height, c)
        assert segment_length(grid.n_h, grid.n_w) <= c.vision_max_n_token
        assert grid.height % 14 == 0 and grid.width % 14 == 0
    small = plan_grid(100, 100, c)  # scaled up to the minimum area: 544 x 544
    assert (small.height, small.width) == (546, 546) and (small.n_h, small.n_w) == (13, 13)


def test_patches_are_the_picture_padded_grey_in_reading_order():
    c = preset("tiny-v41-vision")
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (84, 112, 3), generator=g, dtype=torch.uint8)
    image = PIL.fromarray(pixels.numpy())
    got = image_input(image, c)
    assert (got.n_vit_h, got.n_vit_w) == (6, 8) and got.grid == (2, 3)
    expected = ((pixels.permute(2, 0, 1).float() / 255 - 0.5) / 0.5).to(torch.bfloat16)
    # patch (1, 2) is rows 14..27, columns 28..41
    assert torch.equal(got.patches[1 * 8 + 2], expected[:, 14:28, 28:42])
    wide = image_input(PIL.fromarray(pixels[:40].numpy()), c)  # padded to keep its aspect
    assert wide.patches.dtype == torch.bfloat16
    grey = (torch.tensor(127.0) / 255 - 0.5) / 0.5
    assert torch.equal(wide.patches[0, :, 0, 0], grey.to(torch.bfloat16).expand(3))


def test_images_come_as_bytes_paths_and_data_urls_and_nothing_is_fetched(tmp_path):
    c = preset("tiny-v41-vision")
    data = png(90, 60)
    (tmp_path / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    inputs = [image_input(source, c) for source in (data, tmp_path / "a.png",
                                                    str(tmp_path / "a.png"), url)]
    assert len({i.digest for i in inputs}) == 1
    assert inputs[0].digest != image_input(png(90, 60, seed=1), c).digest
    for source, message in [
        ("https://example.com/cat.png", "only data: URLs"),
        ("http://example.com/cat.png", "fetches nothing"),
        ("data:image/png,notbase64", "base64"),
        ("data:image/png;base64,@@@", "not valid base64"),
        (b"not an image", "cannot decode"),
        (tmp_path / "missing.png", "cannot read"),
        (3, "expected bytes"),
    ]:
        with pytest.raises(ImageError, match=message):
            image_input(source, c)
    with pytest.raises(ImageError, match="over 100 bytes"):
        read_image_bytes(data, max_bytes=100)
    with pytest.raises(ImageError, match="no vision tower"):
        image_input(data, preset("tiny-v41"))


def test_placeholders_become_spans_and_must_match_the_images():
    c = preset("tiny-v41-vision")
    image = image_input(png(90, 60), c)
    ids, segments = expand_images([5, c.image_token_id, 7], [image], c)
    assert segments == [ImageSegment(1, image)]
    assert ids == [5] + [c.image_token_id] * image.n_positions + [7]
    with pytest.raises(ImageError, match=r"1 image placeholders .* and 2 images"):
        expand_images([5, c.image_token_id], [image, image], c)


def test_the_tower_fills_the_span_with_the_delimiters_and_the_aligner_rows(seeing):
    model, c = seeing, seeing.config
    image = image_input(png(100, 70), c)
    rows = segment_rows(model, image)
    types = segment_types(*image.grid)
    assert torch.equal(rows[0], model.image_start.float())
    assert torch.equal(rows[-1], model.image_end.float())
    assert torch.equal(rows[image.grid[1] + 1], model.image_newline.float())
    # the aligner's rows: each 3 x 3 square of patch features, channel major, zero padded
    with torch.no_grad():
        features = model.vision(image.patches.float(), image.n_vit_h, image.n_vit_w)
        n_h, n_w = image.grid
        grid = torch.zeros(n_h * 3, n_w * 3, c.vision_dim)
        grid[: image.n_vit_h, : image.n_vit_w] = features.view(image.n_vit_h, image.n_vit_w, -1)
        squares = grid.view(n_h, 3, n_w, 3, -1).permute(0, 2, 4, 1, 3).reshape(n_h * n_w, -1)
        aligned = model.aligner.w2(torch.nn.functional.gelu(model.aligner.w1(squares)))
    assert torch.allclose(rows[types == IMAGE], aligned, atol=1e-5)


def test_image_positions_route_by_their_own_bias(seeing):
    model, c = seeing, seeing.config
    gate = model.layers[2].ffn.gate
    x = torch.randn(6, c.dim)
    image = torch.tensor([False, True, False, True, True, False])
    with torch.no_grad():
        saved = gate.bias_vl.clone()
        gate.bias_vl.fill_(-100.0)
        gate.bias_vl[3] = 100.0
        _, chosen = gate(x, image)
        _, plain = gate(x)
        gate.bias_vl.copy_(saved)
    assert (chosen[image] == 3).any(-1).all()
    assert torch.equal(chosen[~image], plain[~image])


def test_engram_skips_image_positions(seeing):
    model, c = seeing, seeing.config
    h = model.engram_hash
    k = c.engram_max_ngram_size - 1
    m = c.image_token_id
    ids = torch.tensor([[11, 12, m, m, 13, 14]])
    rows = h(ids, torch.zeros(1, k, dtype=torch.long), 0)
    # after an image, a token hashes as if the sequence started there
    alone = h(torch.tensor([[13, 14]]), torch.zeros(1, k, dtype=torch.long), 0)
    assert torch.equal(rows[:, 4:], alone)
    assert not torch.equal(rows[:, 1], alone[:, 0])  # text before it still looks back
    # the gate is shut at image positions: the residual passes as it is
    engram = model.layers[1].engram
    x = torch.randn(1, 6, c.hc_mult, c.dim)
    live = torch.tensor([[True, True, False, False, True, True]])
    with torch.no_grad():
        out = engram(x, rows[:, :, 0], live)
        opened = engram(x, rows[:, :, 0])
    assert torch.equal(out[:, 2:4], x[:, 2:4])
    assert torch.equal(out[live], opened[live]) and not torch.equal(out, opened)


def test_a_prompt_with_images_prefills_alike_in_any_chunks(seeing):
    model, c = seeing, seeing.config
    images = [image_input(png(100, 70), c), image_input(png(60, 120, seed=2), c)]
    ids, segments = prompt_with(model, images)
    with torch.no_grad():
        whole = model(ids, images=segments).logits[:, -1]
        outputs = []
        for chunk in (512, 7, 3):
            store = ReferenceStore(c, 1, ids.device)
            outputs.append(model.prefill(ids, store, replay="exact", chunk_size=chunk,
                                         images=segments))
        # a prompt spread over calls, a segment cut between them
        store = ReferenceStore(c, 1, ids.device)
        cut = segments[0].start + 3
        model.prefill_part(ids[:, :cut], store, chunk_size=5, images=segments)
        outputs.append(model.prefill(ids[:, cut:], store, replay="exact", images=segments))
    for out in outputs:
        assert torch.allclose(out, whole, atol=1e-4), (out - whole).abs().max()
    # the image changes the answer
    other = [image_input(png(100, 70, seed=5), c), images[1]]
    with torch.no_grad():
        changed = model(ids, images=[ImageSegment(s.start, i) for s, i in zip(segments, other,
                                                                          strict=True)])
    assert not torch.allclose(changed.logits[:, -1], whole, atol=1e-3)


def test_image_positions_must_be_exactly_the_spans(seeing):
    model, c = seeing, seeing.config
    image = image_input(png(100, 70), c)
    ids, segments = prompt_with(model, [image])
    with pytest.raises(ValueError, match=f"position {segments[0].start} holds the image token"):
        model(ids)
    moved = [ImageSegment(segments[0].start + 1, image)]
    with pytest.raises(ValueError, match="must mark exactly the positions"):
        model(ids, images=moved)
    with pytest.raises(ValueError, match="runs one sequence"):
        model(ids.repeat(2, 1), images=segments)
    text_only = Model(preset("tiny-v41"))
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(ids[:, :5], images=segments)


def test_vision_tensors_load_and_export_byte_for_byte(tmp_path, seeing):
    model = seeing
    files = export_v41(model, tmp_path / "out")
    written: dict[str, torch.Tensor] = {}
    for file in files:
        written.update(load_file(str(tmp_path / "out" / file)))
    original = write_v41_checkpoint(tmp_path / "again", model.config, seed=SEED, shards=0)
    tower = {n for n in original if n.startswith(("vision.", "aligner.", "image_"))
             or n.endswith("bias_vl")}
    assert tower == {n for n in written if n.startswith(("vision.", "aligner.", "image_"))
                     or n.endswith("bias_vl")}
    assert len(tower) == len(vision_parameter_shapes(model.config)) + model.config.n_layers
    for name in tower:
        assert torch.equal(written[name].float(), original[name].float()), name
    assert not model.checkpoint_report.skipped.keys() & tower


def test_vision_keys_validate_and_map_from_hf_names():
    c = preset("tiny-v41-vision")
    assert c.has_vision and not preset("tiny-v41").has_vision
    assert ModelConfig.from_dict(hf_config(c)) == c
    assert ModelConfig.from_dict(inference_config(c)) == c
    flash = preset("deepseek-v4.1-flash")
    hf = hf_config(flash)
    hf["vision_config"] = {}  # HF's defaults are V4.1-Flash's tower
    assert ModelConfig.from_dict(hf) == flash
    no_tower = hf_config(flash)
    del no_tower["vision_config"]
    assert not ModelConfig.from_dict(no_tower).has_vision
    bad = hf_config(c)
    bad["vision_config"]["spatial_merge"] = 2
    with pytest.raises(ValueError, match=r"vision_config\.spatial_merge: not built"):
        ModelConfig.from_dict(bad)
    for changes, message in [
        (dict(vision_n_heads=3), "vision_n_heads = 3"),
        (dict(vision_dim=20), "head width"),
        (dict(image_token_id=512), "image_token_id = 512"),
        (dict(vision_max_n_token=3), "at least 4 positions"),
        (dict(vision_max_wh_ratio=0), "vision_max_wh_ratio = 0"),
        (dict(vision_patch_size=0), "vision_patch_size = 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            c.replace(**changes)


def test_the_plan_counts_the_tower_apart_and_prices_a_picture(seeing):
    c = seeing.config
    plan, trunk = make_plan(c, "v", image_size=(100, 70)), make_plan(preset("tiny-v41"), "t")
    tower = [seeing.vision, seeing.aligner]
    assert plan["params_vision"] == count_parameters(c).vision == \
        sum(p.numel() for m in tower for p in m.parameters()) + 3 * c.dim > 0
    assert plan["params_total"] == trunk["params_total"] + c.n_layers * c.n_routed_experts
    image = plan["vision"]["image"]
    grid = image_input(png(100, 70), c).grid
    assert image["grid"] == list(grid)
    assert image["positions"] == segment_length(*grid)
    assert image["cache_bytes"] == image["positions"] * plan["bytes_per_token"]
    assert "vision" not in trunk
    assert json.dumps(plan)


# ---- the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(seeing, tmp_path_factory):
    from kvstack import LLM

    directory = tmp_path_factory.mktemp("engine")
    write_v41_checkpoint(directory, preset("tiny-v41-vision"), seed=SEED, shards=0)
    return LLM(directory, kv_budget="64MiB", block_tokens=8,
               cache_dir=tmp_path_factory.mktemp("cache"))


def greedy_by_hand(model: Model, ids: list[int], segments: list[ImageSegment], n: int) -> list[int]:
    """The model's own greedy tokens: a whole-prompt prefill, then one token a step."""
    store = ReferenceStore(model.config, 1, torch.device("cpu"))
    with torch.no_grad():
        logits = model.prefill(torch.tensor([ids]), store, images=segments)
        out = [int(logits.argmax())]
        for _ in range(n - 1):
            out.append(int(model.decode(torch.tensor([out[-1]]), store).argmax()))
    return out


def test_the_engine_generates_with_images_as_the_model_does(engine, seeing):
    from kvstack import SamplingParams

    c = seeing.config
    greedy = SamplingParams(max_tokens=6, temperature=0)
    picture = png(100, 70, 1)
    text = list(b"what is this? ")
    out = engine.generate({"prompt_token_ids": [*text[:5], c.image_token_id, *text[5:]],
                           "multi_modal_data": {"image": picture}}, greedy)[0]
    image = image_input(picture, c)
    ids, segments = expand_images([*text[:5], c.image_token_id, *text[5:]], [image], c)
    assert out.prompt_token_ids == ids
    assert out.token_ids == greedy_by_hand(seeing, ids, segments, 6)
    # no placeholder: the pictures go before the text; images= is the same as the dict
    first = engine.generate({"prompt_token_ids": text, "multi_modal_data": {"image": [picture]}},
                            greedy)[0]
    request = engine.add_request(text, greedy, images=[picture], watch=True)
    again = engine.wait(request)
    while not again.finished:
        again = engine.wait(request)
    assert first.prompt_token_ids[: image.n_positions] == [c.image_token_id] * image.n_positions
    assert again.token_ids == first.token_ids == greedy_by_hand(
        seeing, first.prompt_token_ids, [ImageSegment(0, image)], 6)


def test_the_prefix_cache_names_image_blocks_by_the_picture(engine, seeing):
    from kvstack import SamplingParams

    c = seeing.config
    greedy = SamplingParams(max_tokens=4, temperature=0)
    text = list(b"and this one, in detail? ")

    def ask(picture: bytes):
        return engine.generate({"prompt_token_ids": [c.image_token_id, *text],
                                "multi_modal_data": {"image": picture}}, greedy)[0]

    cold = ask(png(120, 90, 7))
    hit = ask(png(120, 90, 7))
    other = ask(png(120, 90, 8))
    segment = image_input(png(120, 90, 7), c).n_positions
    assert cold.num_cached_tokens == 0
    assert hit.num_cached_tokens >= segment  # the image's blocks were found
    assert other.num_cached_tokens == 0  # same ids, another picture: nothing found
    assert hit.token_ids == cold.token_ids
    ids, segments = expand_images([c.image_token_id, *text], [image_input(png(120, 90, 8), c)], c)
    assert other.token_ids == greedy_by_hand(seeing, ids, segments, 4)


def test_a_prompt_with_images_spread_over_steps_equals_one_prefill(seeing, tmp_path):
    from kvstack import LLM, SamplingParams

    c = seeing.config
    pictures = [png(100, 70, 3), png(60, 120, 4)]
    text = [*b"compare ", c.image_token_id, *b" with ", c.image_token_id]
    # 16 tokens a step: the prompt (47 positions) is prefilled over three steps, its
    # segments cut between them, beside another request decoding
    llm = LLM(_saved(seeing, tmp_path), kv_budget="64MiB",
              block_tokens=8, max_num_batched_tokens=16, chunk_size=5,
              cache_dir=tmp_path / "cache", enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    busy = llm.add_request(list(b"meanwhile"), SamplingParams(max_tokens=20, temperature=0))
    out = llm.generate({"prompt_token_ids": text, "multi_modal_data": {"image": pictures}},
                       greedy)[0]
    assert llm.has_request(busy)
    ids, segments = expand_images(text, [image_input(p, c) for p in pictures], c)
    assert len(ids) > 32
    assert out.token_ids == greedy_by_hand(seeing, ids, segments, 5)
    assert llm.model.encoded_images.encoded == 2  # each picture once, whatever the parts
    report = llm.memory_report()["positions"]
    assert report["image"]["positions"] == 0  # finished: nothing held


def _saved(model: Model, tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    write_v41_checkpoint(directory, model.config, seed=SEED, shards=0)
    return directory


def test_bad_image_requests_are_refused_naming_the_problem(engine, seeing, tmp_path):
    from kvstack import LLM, SamplingParams

    c = seeing.config
    p = SamplingParams(max_tokens=2)
    picture = png(50, 50)
    for prompt, message in [
        ({"prompt_token_ids": [1, c.image_token_id, c.image_token_id],
          "multi_modal_data": {"image": picture}}, "2 image placeholders"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": "https://x.org/a.png"}},
         "fetches nothing"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": b"GIF89a broken"}},
         "cannot decode"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"video": picture}},
         "takes 'image' only"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "holds 'prompt'"),
        ([1, c.image_token_id, 2], "must mark exactly"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompt, p)
    assert not engine.has_unfinished_requests()
    text_only = LLM("tiny-v41", random_init=True, kv_budget="16MiB",
                    cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate({"prompt_token_ids": [1, 2],
                            "multi_modal_data": {"image": picture}}, p)


def test_memory_report_counts_image_positions_apart(engine, seeing):
    from kvstack import SamplingParams

    c = seeing.config
    picture = png(100, 70, 9)
    segment = image_input(picture, c).n_positions
    request = engine.add_request(list(b"keep this: "), SamplingParams(max_tokens=2),
                                 images=[picture], keep_cache=True, watch=True)
    out = engine.wait(request)
    while not out.finished:
        out = engine.wait(request)
    report = engine.memory_report()
    positions = report["positions"]
    assert positions["image"]["positions"] == segment
    held = len(out.prompt_token_ids) + len(out.token_ids) - 1  # the last token is not fed
    assert positions["all"]["positions"] == held
    assert positions["text"]["positions"] == held - segment
    for kind in ("text", "image", "all"):
        assert positions[kind]["bytes_per_token"] == report["bytes_per_token"]
    held = report["encoded_images"]
    assert held["held"] >= 1 and held["bytes"] >= segment * seeing.config.dim * 4
    engine.release(request)


def test_the_openai_client_sends_pictures_to_kvstack_serve(tmp_path, seeing):
    """A chat with a base64 PNG through the official client; the same picture again hits
    the prefix cache (its cached tokens count the image segment), another does not; a URL,
    a broken picture and a text-only model's server give 400s naming the problem; the
    cache's image positions reach /metrics; a session's turns with pictures continue its
    cache and resume after a restart."""
    openai = pytest.importorskip("openai")
    from tests.test_serve import Server

    model = _saved(seeing, tmp_path)
    server = Server(tmp_path / "cache", "--model", str(model), "--served-model-name", "v",
                    "--max-image-bytes", "64KiB")
    try:
        c = seeing.config

        def ask(picture: bytes | str, text: str = "What is in this picture? " * 4):
            url = picture if isinstance(picture, str) else \
                "data:image/png;base64," + base64.b64encode(picture).decode()
            return server.client.chat.completions.create(
                model="v", max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": text}]}])

        first, again, other = ask(png(120, 90, 7)), ask(png(120, 90, 7)), ask(png(120, 90, 8))
        segment = image_input(png(120, 90, 7), c).n_positions
        assert first.choices[0].message.content is not None
        assert first.usage.prompt_tokens > segment
        cached = lambda r: (r.usage.prompt_tokens_details.cached_tokens  # noqa: E731
                            if r.usage.prompt_tokens_details else 0)
        assert cached(first) == 0 and cached(again) >= segment and cached(other) == 0
        assert again.choices[0].message.content == first.choices[0].message.content
        for picture, message in [("https://example.com/cat.png", "fetches nothing"),
                                 ("data:image/png;base64,aGVsbG8=", "cannot decode"),
                                 (png(300, 300) * 3, "over 65,536 bytes")]:
            with pytest.raises(openai.BadRequestError, match=message):
                ask(picture)
        text = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert 'kvstack:cache_positions{kind="image",model_name="v"}' in text
        assert 'kvstack:cache_position_bytes{kind="all",model_name="v"}' in text
    finally:
        assert server.stop() == 0
    # A session whose conversation holds pictures: the second turn (a new picture in it)
    # continues the kept cache; after a restart the third resumes it from disk and
    # answers as the same conversation sent afresh does (exact replay).
    def part(picture: bytes) -> dict:
        return {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(picture).decode()}}

    def talk(s: Server, messages: list, session: str | None = "look"):
        return s.client.chat.completions.create(
            model="v", max_tokens=4, temperature=0, messages=messages,
            extra_headers={"x-kvstack-session": session} if session else None)

    def reply(r) -> dict:
        return {"role": "assistant", "content": r.choices[0].message.content}

    opening = [{"role": "user", "content": [part(png(90, 90, 3)),
                                            {"type": "text", "text": "What is it?"}]}]
    server = Server(tmp_path / "cache3", "--model", str(model), "--served-model-name", "v")
    try:
        first = talk(server, opening)
        follow = [*opening, reply(first), {"role": "user", "content": [
            {"type": "text", "text": "And this?"}, part(png(60, 80, 4))]}]
        second = talk(server, follow)
        assert cached(second) >= first.usage.prompt_tokens
    finally:
        assert server.stop() == 0
    conversation = [*follow, reply(second), {"role": "user", "content": "Compare them."}]
    server = Server(tmp_path / "cache3", "--model", str(model), "--served-model-name", "v")
    try:
        resumed = talk(server, conversation)
        assert server.metric("sessions_resumed_total") == 1
        assert cached(resumed) >= second.usage.prompt_tokens
        afresh = talk(server, conversation, session=None)
        assert resumed.choices[0].message.content == afresh.choices[0].message.content
    finally:
        assert server.stop() == 0
    plain = Server(tmp_path / "cache2", "--random-init", "--model", "tiny-v41",
                   "--served-model-name", "t")
    try:
        with pytest.raises(openai.BadRequestError, match="no vision tower"):
            plain.client.chat.completions.create(model="t", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(png(20, 20)).decode()}}]}])
    finally:
        assert plain.stop() == 0


def test_an_image_position_costs_the_layouts_890_bytes(tmp_path):
    """At V4.1-Flash's cache layout (its layers, head and index widths, window and formats
    on a small trunk), the engine's measured bytes per image position are 890."""
    from kvstack import LLM, SamplingParams

    c = preset("v41-layout-small").replace(
        vision_n_layers=1, vision_dim=32, vision_n_heads=2, vision_inter_dim=32,
        vision_max_n_token=64, vision_min_pixels=84 * 84, image_token_id=500)
    llm = LLM(c, random_init=True, kv_budget="64MiB", cache_dir=tmp_path)
    picture = png(100, 70)
    request = llm.add_request([1, 2, 3], SamplingParams(max_tokens=1), images=[picture],
                              keep_cache=True, watch=True)
    while not llm.wait(request).finished:
        pass
    positions = llm.memory_report()["positions"]
    assert positions["image"]["positions"] == image_input(picture, c).n_positions
    assert positions["image"]["bytes_per_token"] == 890
    assert positions["image"]["bytes"] == 890 * positions["image"]["positions"]


def test_a_session_with_pictures_resumes_in_another_process_token_for_token(seeing,
                                                                            tmp_path):
    """Saved with its pictures (the last one inside what the exact replay re-runs), resumed in
    another process: the next turn's tokens are the uninterrupted conversation's."""
    import subprocess
    import sys
    import textwrap

    from kvstack import LLM, SamplingParams

    model = _saved(seeing, tmp_path)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    settings = dict(kv_budget="64MiB", replay="exact", block_tokens=8)
    llm = LLM(model, cache_dir=tmp_path / "cache", **settings)
    session = llm.session("look")
    session.append(list(b"first, this: "), images=[png(100, 70, 11)])
    session.generate(greedy)
    session.append(list(b" and now this one"), images=[png(60, 120, 12)])
    session.save()
    uninterrupted = session.generate(greedy).token_ids
    saved = llm.disk.show("look")
    assert [i["start"] for i in saved.images] == [s.start for s in session.images]
    assert len(session.images) == 2

    script = textwrap.dedent(f"""
        import json
        from kvstack import LLM, SamplingParams
        llm = LLM({str(model)!r}, cache_dir={str(tmp_path / "cache")!r}, **{settings!r})
        out = llm.resume("look").generate(SamplingParams(max_tokens=6, temperature=0,
                                                         ignore_eos=True))
        print(json.dumps(out.token_ids))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[1])
    assert json.loads(done.stdout.strip().splitlines()[-1]) == uninterrupted
    # the picture's file is checked: a damaged one fails the resume naming it
    path = llm.disk.block_path(saved.images[0]["file"])
    path.write_bytes(b"broken")
    with pytest.raises(ValueError, match=r"picture file .* is corrupt"):
        llm.resume("look")


def test_keep_last_drops_a_picture_it_would_cut(seeing, tmp_path):
    from kvstack import LLM

    llm = LLM(_saved(seeing, tmp_path), cache_dir=tmp_path / "cache", kv_budget="64MiB")
    session = llm.session("cut")
    session.append(list(b"ab"), images=[png(100, 70)])
    segment = session.images[0]
    session.keep_last(len(session.token_ids) - segment.start - 1)  # inside the segment
    assert session.images == [] and session.token_ids == list(b"ab")


def test_the_commands_take_pictures(seeing, tmp_path, monkeypatch, capsys):
    """`kvstack generate --image` and `kvstack chat`'s /image, saved with the session."""
    from kvstack.cache.disk import DiskTier
    from kvstack.cli import main

    model = _saved(seeing, tmp_path)
    (tmp_path / "a.png").write_bytes(png(100, 70))
    common = ["--model", str(model), "--kv-budget", "64MiB", "--max-tokens", "3",
              "--temperature", "0", "--ignore-eos", "--cache-dir", str(tmp_path / "cache")]
    assert main(["generate", *common, "--prompt", "what is it?", "--image",
                 str(tmp_path / "a.png"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    segment = image_input(png(100, 70), seeing.config).n_positions
    assert out["prompt_token_ids"][:segment] == [seeing.config.image_token_id] * segment
    assert out["memory"]["positions"]["image"]["bytes_per_token"] > 0
    assert main(["generate", *common, "--prompt", "x", "--image",
                 str(tmp_path / "none.png")]) == 2
    assert "cannot read" in capsys.readouterr().err
    lines = iter([f"/image {tmp_path / 'none.png'}", f"/image {tmp_path / 'a.png'}",
                  "and this?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert main(["chat", *common, "--session", "pics"]) == 0
    err = capsys.readouterr().err
    assert "cannot read" in err and "picture 1 added" in err
    saved = DiskTier(tmp_path / "cache", 1 << 30).show("pics")
    assert [i["start"] for i in saved.images] == [0]
    assert len(saved.token_ids) == segment + len("and this?\n") + 3
