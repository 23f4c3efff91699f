"""An off-the-shelf gRPC client (grpcio, stubs generated from proto/ at test time) streams a
generation, and calls health checking and server reflection."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import grpc_generate


def test_generate_streams_tokens(gateway, stubs):
    pb, _ = stubs
    ids, text = grpc_generate(stubs, gateway.grpc, text="1, 2, 3, 4, 5,", max_tokens=8,
                              sampling=pb.SamplingParams(temperature=0.0))
    assert len(ids) == 8
    assert text.startswith(" 6, 7, 8"), text


def test_bad_input_gets_invalid_argument(gateway, stubs):
    pb, pb_grpc = stubs
    with grpc.insecure_channel(gateway.grpc) as channel:
        stub = pb_grpc.InferenceStub(channel)
        try:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=2.0))))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert "top_p" in e.details()
        else:
            raise AssertionError("top_p = 2 was accepted")


def test_health_and_reflection(gateway):
    with grpc.insecure_channel(gateway.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="duet.v1.Inference")).status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"duet.v1.Inference", "grpc.health.v1.Health"} <= names, names
        # The workers' internal services are not served on the public port, so not listed.
        assert not any(n.startswith("duet.v1.") and n != "duet.v1.Inference" for n in names), names


def test_sampling_without_a_seed_differs(stubs, gateway):
    pb, _ = stubs
    texts = {grpc_generate(stubs, gateway.grpc, text="Tell me a story:", max_tokens=32, sampling=pb.SamplingParams(temperature=1.0))[1] for _ in range(3)}
    assert len(texts) == 3, f"three unseeded samples at temperature 1 were not all different: {texts}"


def test_the_seed_drawn_is_in_the_response_metadata_and_reproduces_the_sample(stubs, gateway):
    pb, pb_grpc = stubs
    request = dict(text="Tell me a story:", max_tokens=32)
    with grpc.insecure_channel(gateway.grpc) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(**request, sampling=pb.SamplingParams(temperature=1.0)))
        seed = int(dict(call.initial_metadata())["x-duet-seed"])
        ids = [m.token.id for m in call if m.WhichOneof("event") == "token"]
    again, _ = grpc_generate(stubs, gateway.grpc, **request, sampling=pb.SamplingParams(temperature=1.0, seed=seed))
    assert again == ids


def test_output_constraint_over_grpc(stubs, gateway):
    pb, _ = stubs
    sampling = pb.SamplingParams(temperature=1.0, seed=5, constraint=pb.OutputConstraint(regex=r"(red|green|blue)!"))
    _, text = grpc_generate(stubs, gateway.grpc, text="A colour:", max_tokens=10, sampling=sampling)
    assert text in ("red!", "green!", "blue!"), text
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(stubs, gateway.grpc, text="x", max_tokens=2, sampling=pb.SamplingParams(constraint=pb.OutputConstraint(lark="start: (")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
