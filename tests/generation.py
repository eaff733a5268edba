"""Talking to a generative model with the real tritonclient: a prompt tensor,
a stream whose responses land in a queue, and readers of the answers. Shared
by the agent's and the router's generative tests."""

from __future__ import annotations

import queue

import numpy as np
import tritonclient.grpc as grpcclient

PROMPT = "the quick brown fox"


def prompt_input(text: str = PROMPT) -> grpcclient.InferInput:
    item = grpcclient.InferInput("text_input", [1], "BYTES")
    item.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return item


def generate(client, model: str = "tiny", text: str = PROMPT, headers: dict | None = None,
             **parameters):
    """The whole answer, over ModelInfer."""
    return client.infer(model, [prompt_input(text)], parameters=parameters or None,
                        headers=headers)


class Stream:
    """A tritonclient stream whose responses land in a queue."""

    def __init__(self, client: grpcclient.InferenceServerClient) -> None:
        self.client = client
        self.responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str = "tiny", text: str = PROMPT, request_id: str = "",
             **parameters) -> None:
        # Hints travel as parameters: a stream's metadata is the whole stream's.
        self.client.async_stream_infer(model, [prompt_input(text)], request_id=request_id,
                                       parameters=parameters or None)

    def next(self, timeout: float = 60.0):
        result, error = self.responses.get(timeout=timeout)
        if error is not None:
            raise error
        return result

    def until_final(self, timeout: float = 60.0) -> list:
        results = []
        while True:
            results.append(self.next(timeout))
            if is_final(results[-1]):
                return results


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def text_of(result) -> str:
    return result.as_numpy("text_output")[0].decode()


def ids_of(result) -> list[int]:
    return [int(i) for i in result.as_numpy("token_ids")]
