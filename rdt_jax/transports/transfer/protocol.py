"""The offer protocol between a consumer and a producer's offer service.

Messages are length-prefixed JSON (`send` / `receive`): a 4-byte big-endian
length, then one JSON object of at most `_limits.TRANSFER_MAX_MESSAGE` bytes. Nothing received
is unpickled, and every field is checked (`offer_request`); a peer that sends
anything else gets a `ProtocolError`, and the connection ends.

A connection starts with an HMAC-SHA256 challenge on the key from the
object's metadata (`challenge` on the service's side, `answer_challenge` on
the consumer's): the service sends `{"nonce"}`, the consumer answers
`{"mac"}`, and the service accepts with `{"ok": true}` or closes the
connection. The key keeps peers that never saw an object's metadata (a port
scan, a stray client) from having objects offered; anyone who can read the
metadata from Ray's object store holds it, so it protects nothing from
processes of the Ray cluster itself.

Then the consumer sends, one at a time:

* `{"op": "offer", "obj", "uuid", "cuts"}`: offer object `obj`'s arrays for
  one pull under `uuid` (`cuts`: per offered array, None or the boxes to cut
  from it, one `[start, stop]` per axis each); the service answers
  `{"error": null}`, or `{"error": why}` when it cannot;
* `{"op": "done", "uuid"}`: offer `uuid` was pulled (no answer).

The service waits for the challenge's answer, and the consumer for each of
the service's answers, at most `_limits.TRANSFER_ANSWER_TIMEOUT_S`; between requests the
service waits as long as the consumer keeps the connection.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from rdt_jax import _limits


class ProtocolError(Exception):
  """A peer of the offer protocol sent something the protocol does not allow."""


def send(sock: socket.socket, message: dict[str, Any]) -> None:
  data = json.dumps(message, separators=(",", ":")).encode()
  sock.sendall(struct.pack(">I", len(data)) + data)


def receive(
    sock: socket.socket, deadline: float | None = None, interrupted: Callable[[], bool] | None = None
) -> dict[str, Any]:
  """One message: a JSON object of at most `_limits.TRANSFER_MAX_MESSAGE` bytes.

  Waits until `deadline` (`time.monotonic()`; None: no limit), checking
  `interrupted` every 0.1 s.

  Raises:
    EOFError: the peer closed the connection.
    TimeoutError: the deadline passed.
    InterruptedError: `interrupted()` turned True.
    ProtocolError: a message too long, not JSON, or not an object.
  """
  header = _receive_exactly(sock, 4, deadline, interrupted)
  (n,) = struct.unpack(">I", header)
  if n > _limits.TRANSFER_MAX_MESSAGE:
    raise ProtocolError(f"a message of {n} bytes (at most {_limits.TRANSFER_MAX_MESSAGE})")
  try:
    message = json.loads(_receive_exactly(sock, n, deadline, interrupted))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ProtocolError(f"a message that is not JSON ({e})") from None
  if type(message) is not dict:
    raise ProtocolError("a message that is not a JSON object")
  return message


def _receive_exactly(
    sock: socket.socket, n: int, deadline: float | None, interrupted: Callable[[], bool] | None
) -> bytes:
  chunks, left = [], n
  while left:
    if deadline is not None or interrupted is not None:
      wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
      if deadline is not None and wait <= 0:
        raise TimeoutError
      sock.settimeout(max(wait, 0.001))
    try:
      data = sock.recv(min(left, 1 << 16))
    except TimeoutError:  # socket.timeout
      if interrupted is not None and interrupted():
        raise InterruptedError from None
      continue
    if not data:
      raise EOFError
    chunks.append(data)
    left -= len(data)
  return b"".join(chunks)


def mac(key: bytes, nonce: str) -> str:
  return hmac.new(key, bytes.fromhex(nonce), hashlib.sha256).hexdigest()


def challenge(conn: socket.socket, key: bytes) -> bool:
  """The service's side of the challenge: True once the peer proved it holds
  `key` (and was told so; the connection then blocks without a timeout),
  False if it answered wrongly.

  Raises:
    EOFError, TimeoutError, ProtocolError: as `receive` (no answer within
      `_limits.TRANSFER_ANSWER_TIMEOUT_S`); OSError: the connection failed.
  """
  nonce = secrets.token_hex(32)
  send(conn, {"nonce": nonce})
  answer = receive(conn, time.monotonic() + _limits.TRANSFER_ANSWER_TIMEOUT_S)
  if not isinstance(answer.get("mac"), str) or not hmac.compare_digest(answer["mac"], mac(key, nonce)):
    return False
  conn.settimeout(None)
  send(conn, {"ok": True})
  return True


def answer_challenge(sock: socket.socket, key: bytes, interrupted: Callable[[], bool] | None = None) -> None:
  """The consumer's side of the challenge: answers it with `key`, waiting for
  the service at most `_limits.TRANSFER_ANSWER_TIMEOUT_S` in all.

  Raises:
    ProtocolError: no challenge came, or the answer was not accepted.
    ValueError: the nonce is not hex.
    EOFError, TimeoutError, InterruptedError: as `receive`; OSError: the
      connection failed.
  """
  deadline = time.monotonic() + _limits.TRANSFER_ANSWER_TIMEOUT_S
  nonce = receive(sock, deadline, interrupted).get("nonce")
  if not isinstance(nonce, str):
    raise ProtocolError("no challenge")
  send(sock, {"mac": mac(key, nonce)})
  if receive(sock, deadline, interrupted).get("ok") is not True:
    raise ProtocolError("the challenge was not accepted")


def offer_request(message: dict[str, Any]) -> tuple[str, int, list[Any] | None]:
  """`(obj_id, uuid, cuts)` of an "offer" message, every field checked.

  Raises:
    ProtocolError: naming the field that does not hold what the protocol allows.
  """
  obj_id, uuid, cuts = message.get("obj"), message.get("uuid"), message.get("cuts")
  if not isinstance(obj_id, str) or not 0 < len(obj_id) <= 256:
    raise ProtocolError("an offer without an object id")
  if type(uuid) is not int or not 0 <= uuid < 1 << 63:
    raise ProtocolError("an offer without a uuid")
  if cuts is not None:
    if type(cuts) is not list or not all(c is None or _is_boxes(c) for c in cuts):
      raise ProtocolError("an offer whose cuts are not boxes")
    cuts = [None if c is None else [tuple(tuple(r) for r in box) for box in c] for c in cuts]
  return obj_id, uuid, cuts


def _is_boxes(value: Any) -> bool:
  return type(value) is list and all(
      type(box) is list and all(
          type(r) is list and len(r) == 2 and all(type(v) is int and v >= 0 for v in r) and r[0] <= r[1]
          for r in box
      )
      for box in value
  )
