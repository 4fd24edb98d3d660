"""Wire format between the SGLang worker and the SSD draft process (this package is the ONLY code that knows it).

A message is one ZeroMQ multipart message (after the ROUTER identity frame, if any):

    frame 0      msgpack map  {"magic": "sglang-ssd", "version": 1, "type": <name>, "req_id": <int>,
                               "fields": {<scalar / list fields>},
                               "arrays": [[<name>, <dtype str>, <shape list>], ...]}
    frame 1..n   raw little-endian C-order buffers of the declared arrays, in declaration order

Never pickle.  ``decode`` checks magic, version, message type, the exact field set and field types,
each array's dtype / rank against the message schema, ``prod(shape) * itemsize == len(buffer)``,
frame counts and size limits; any violation raises ``ProtocolError`` (both ends log and reject).
``req_id`` pairs a reply with its request so a DEALER whose call timed out can discard late replies.
"""

from sglang_ssd.protocol.framing import (BACKUPS, MAGIC, MAX_BATCH, MAX_FAN_OUT, MAX_FRAME_BYTES,  # noqa: F401
                                         MAX_HEADER_BYTES, MAX_K, MAX_MESSAGE_STR, MAX_PROMPT_TOKENS, MAX_STR,
                                         MAX_VOCAB, MESSAGE_TYPES, MODES, PROTOCOL_VERSION, Buffer, Frames, Message,
                                         ProtocolError, _header, decode, peek_req_id)
from sglang_ssd.protocol.messages import (Ack, ErrorReply, Health, HealthReply, Hello, HelloReply,  # noqa: F401
                                          Prefill, Release, Shutdown, SpecReply, Speculate)
