"""What the scheduler side hands to the workers each step (pickled by vLLM into the workers).

Chunk bytes in the "vllm-cpu" and "vllm-paged" layouts: for chunk c of a request, the blocks
`block_ids[c*bpc : (c+1)*bpc]` (bpc = chunk_size / block_size) of every layer, layer-major:
[layer 0: block 0 | block 1 | ...][layer 1: ...]..., each block copied as its raw bytes. Moving
whole blocks keeps the copy a plain memcpy whatever the attention backend does inside a block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot_connector.protocol import LookupReply


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy the request's read-locked chunks `first_chunk..first_chunk+num_chunks` into blocks.

    `block_ids[j]` holds the request's tokens [j*block_size, (j+1)*block_size); blocks before
    `skip_blocks` are already computed locally and are not written.
    """

    request_id: str
    block_ids: tuple[int, ...]
    first_chunk: int
    num_chunks: int
    skip_blocks: int = 0
    asynchronous: bool = False  # vLLM waits for it in finished_recving (else it runs before the forward)
    #: per kv rank, the scheduler's LOOKUP reply naming the locked chunks (`Lookup.extents`): the
    #: worker copies from them with no RETRIEVE; empty (chunks came from L2 after the lookup): it asks
    located: tuple[LookupReply, ...] = ()
    #: the engine instance whose scheduler looked up (a worker acting for another one asks instead)
    instance: str = ""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the request's full chunks `first_chunk..first_chunk+num_chunks`, computed this step."""

    request_id: str
    tokens: bytes  # uint32 LE tokens (prompt, then generated) up to the end of the last chunk saved
    cache_salt: str
    block_ids: tuple[int, ...]
    first_chunk: int
    num_chunks: int
    extra_keys: tuple[bytes, ...] = ()  # per chunk from chunk 0 (protocol.Lookup.extra_keys)
    prompt_tokens: int = 0  # the request's prompt length: chunks ending after it hold generated tokens
    lora_name: str = ""  # the request's LoRA adapter (lora_request.lora_name), for the sidecar's events


@dataclass(frozen=True, slots=True)
class StepPlan:
    """`sending`: finished requests whose blocks vLLM keeps for this step's saves; the workers
    report them finished_sending once those saves are done, or failed (so the blocks are freed).
    `instance`: the scheduler's engine instance nonce, which the workers join before acting
    (vllm/identity.py: this is how it reaches them, privately)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    sending: list[str] = field(default_factory=list)
    instance: str = ""
