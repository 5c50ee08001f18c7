"""The merged event stream of a request for ``n > 1`` choices fanned out over ``n`` requests
(``dlmix.router.choices._Stream``): one stream, so one ``id`` (and ``created``) on every chunk, as in an OpenAI
stream, although each choice's engine names its own."""
import json

from dlmix.router.choices import _Stream


class _Transport:
    def __init__(self):
        self.data = b""

    def write(self, b: bytes) -> None:
        self.data += b


class _Client:
    def __init__(self):
        self.transport = _Transport()
        self.closed = False


class _Conn:
    def __init__(self, index: int):
        self.index = index


def _events(raw: bytes):
    """The JSON events of the chunked SSE body written after the head (``[DONE]`` as the string)."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    out = []
    for line in body.split(b"\r\n"):
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):].strip()
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def _chunk(ident: str, created: int, text: str, finish=None):
    return json.dumps({"id": ident, "object": "chat.completion.chunk", "created": created, "model": "m",
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}).encode()


def test_merged_stream_has_one_id_across_the_choices():
    client = _Client()
    s = _Stream(client, keep_alive=True)
    a, b = _Conn(0), _Conn(1)
    s.event(a, _chunk("chatcmpl-A", 100, "The"))
    s.event(b, _chunk("chatcmpl-B", 101, "Red"))
    s.event(a, _chunk("chatcmpl-A", 100, " sky", "length"))
    s.event(b, json.dumps({"id": "chatcmpl-B", "object": "chat.completion.chunk", "created": 101, "model": "m",
                           "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                    "total_tokens": 9}}).encode())
    s.event(a, json.dumps({"id": "chatcmpl-A", "object": "chat.completion.chunk", "created": 100, "model": "m",
                           "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2,
                                                    "total_tokens": 9}}).encode())
    s.event(b, _chunk("chatcmpl-B", 101, "", "stop"))
    s.finish()
    evs = _events(client.transport.data)
    assert evs[-1] == "[DONE]"
    evs = evs[:-1]
    assert [e["id"] for e in evs] == ["chatcmpl-A"] * 5
    assert [e["created"] for e in evs] == [100] * 5
    assert [[c["index"] for c in e["choices"]] for e in evs] == [[0], [1], [0], [1], []]
    assert evs[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
