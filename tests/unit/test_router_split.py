"""The router's split of a vision-language request (`dataplane`): the
vision tier is asked for the visual tokens alone, and the decoder tier's
request carries them in place of the image, every other field kept."""

from __future__ import annotations

import numpy as np

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import routing
from tiered.router import dataplane, policies

TOKENS = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)


def request(raw: bool, outputs: tuple[str, ...] = ()) -> pb.ModelInferRequest:
    out = pb.ModelInferRequest(model_name="vlm", model_version="2", id="q")
    out.parameters["max_tokens"].int64_param = 5
    out.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor(name=n) for n in outputs)
    text = out.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    image = out.inputs.add(name="image", datatype="UINT8", shape=[2, 2, 3])
    if raw:
        out.raw_input_contents.extend([b"\x05\x00\x00\x00hello", bytes(range(12))])
    else:
        text.contents.bytes_contents.append(b"hello")
        image.contents.uint_contents.extend(range(12))
    return out


def tokens_tensor() -> pb.ModelInferResponse.InferOutputTensor:
    return pb.ModelInferResponse.InferOutputTensor(name="visual_tokens", datatype="FP32",
                                                   shape=list(TOKENS.shape))


def test_the_vision_tier_is_asked_for_the_visual_tokens_alone():
    for outputs in ((), ("text_output",)):
        asked = request(True, outputs)
        sent = pb.ModelInferRequest.FromString(
            dataplane.asking_visual_tokens(asked, asked.SerializeToString()))
        assert [o.name for o in sent.outputs] == ["visual_tokens"]
        assert [t.name for t in sent.inputs] == ["text_input", "image"]
        assert sent.raw_input_contents[1] == bytes(range(12))


def test_the_decoder_tier_gets_the_tokens_in_place_of_the_image():
    for raw in (True, False):
        out, image_bytes = dataplane.with_visual_tokens(request(raw, ("token_ids",)),
                                                        tokens_tensor(), TOKENS.tobytes())
        assert [t.name for t in out.inputs] == ["text_input", "visual_tokens"]
        assert (out.model_name, out.model_version, out.id) == ("vlm", "2", "q")
        assert out.parameters["max_tokens"].int64_param == 5
        assert [o.name for o in out.outputs] == ["token_ids"]
        assert list(out.inputs[1].shape) == [2, 4, 3]
        if raw:
            assert image_bytes == 12 and out.raw_input_contents[1] == TOKENS.tobytes()
        else:
            assert image_bytes > 0 and not out.raw_input_contents
            assert list(out.inputs[1].contents.fp32_contents) == TOKENS.reshape(-1).tolist()


def test_a_request_splits_with_an_image_and_no_tier_hint_only():
    route = routing.ModelRoute(
        tiers={"edge": routing.TierRoute(("a:1",)), "datacenter": routing.TierRoute(("b:1",))},
        split=routing.SplitRoute("edge", "datacenter"))
    plain = policies.RouteRequest("vlm")
    assert dataplane.splits(route, request(True), plain)
    assert not dataplane.splits(route, request(True), policies.RouteRequest("vlm", tier="edge"))
    text_only = request(True)
    del text_only.inputs[1]
    assert not dataplane.splits(route, text_only, plain)
    whole = routing.ModelRoute(tiers=route.tiers)
    assert not dataplane.splits(whole, request(True), plain)


def test_a_split_names_two_tiers_of_the_route():
    import pytest

    from tiered.errors import ConfigError

    tiers = {"models": {"vlm": {"tiers": {"edge": {"agents": ["a:1"]}}}}}
    for split, problem in (({"vision": "edge", "decoder": "datacenter"},
                            "split.decoder: tier 'datacenter' has no entry"),
                           ({"vision": "edge", "decoder": "edge"}, "a split needs two"),
                           ({"vision": "moon", "decoder": "edge"}, "unknown tier 'moon'")):
        document = {"version": 1, "models": {"vlm": {**tiers["models"]["vlm"], "split": split}}}
        with pytest.raises(ConfigError, match=problem):
            routing.parse_table(document)


def test_the_vision_tier_encodes_with_the_version_the_decoder_tier_answers_with():
    route = routing.ModelRoute(
        tiers={"edge": routing.TierRoute(("a:1",), 1, canary=2, canary_weight=0.3,
                                         canary_agents=("c:1",)),
               "datacenter": routing.TierRoute(("b:1",), 1)},
        split=routing.SplitRoute("edge", "datacenter"))
    assert dataplane.split_encoders(route, 1) == [policies.Candidate("edge", "a:1", 1)]
    # The canary staged on the edge only: the datacenter never decodes its tokens.
    assert dataplane.split_encoders(route, 2) == [policies.Candidate("edge", "c:1", 2)]
    staged = routing.ModelRoute(
        tiers={"edge": routing.TierRoute(("a:1",), 1),
               "datacenter": routing.TierRoute(("b:1",), 1, canary=2, canary_weight=0.3)},
        split=routing.SplitRoute("edge", "datacenter"))
    assert dataplane.split_encoders(staged, 2) == []  # whole on the datacenter instead
    asleep = routing.ModelRoute(tiers={"edge": route.tiers["edge"]}, asleep=("datacenter",),
                                split=routing.SplitRoute("edge", "datacenter"))
    assert not dataplane.splits(asleep, request(True), policies.RouteRequest("vlm"))
