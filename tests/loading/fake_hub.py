"""A local stand-in for the few Hugging Face Hub routes huggingface_hub calls, on 127.0.0.1
(point HF_ENDPOINT at `FakeHub.url`), and a baby qwen3moe GGUF writer for its GGUF repos.

Routes (as huggingface_hub 1.x/2.x builds them): `GET /api/models/{repo}[/revision/{rev}]`
(model info, siblings with sizes), `GET /api/models/{repo}/tree/{rev}` (the listing
snapshot_download reads), `HEAD|GET /{repo}/resolve/{rev}/{file}` with X-Repo-Commit, ETag,
Content-Length and Range (206) for resumed downloads. Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
GRANTED = "hf_granted"
"""The token a gated repo lets in."""


@dataclass
class Repo:
    """One repo at its current commit: {path: bytes}."""

    files: dict[str, bytes]
    sha: str = ""
    gated: bool = False


@dataclass
class FakeHub:
    """The server's state; tests add repos and read `requests`."""

    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    """(method, path, Range header) of every request, in order."""
    stall_once: set[str] = field(default_factory=set)
    """Files whose next GET sends half its bytes, then waits for `release` and hangs up."""
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def put(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> str:
        """Adds or replaces `repo_id`'s files (a new commit); returns the commit sha."""
        digest = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest())
                                          for k, v in files.items())).encode()).hexdigest()
        self.repos[repo_id] = Repo(dict(files), digest, gated)
        return digest

    def put_dir(self, repo_id: str, directory: Path) -> str:
        """A repo of every file in `directory`."""
        return self.put(repo_id, {p.name: p.read_bytes() for p in sorted(directory.iterdir())
                                  if p.is_file()})


def serve(hub: FakeHub) -> ThreadingHTTPServer:
    """Starts the server in a daemon thread; sets `hub.url`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self._handle(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._handle(body=True)

        def _handle(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            api, resolve = _API.match(path), _RESOLVE.match(path)
            matched = api or resolve
            repo = hub.repos.get(matched[1]) if matched else None
            if repo is None or matched is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if repo.gated and self.headers.get("Authorization") != f"Bearer {GRANTED}":
                return self._error(401, "GatedRepo", f"Access to model {matched[1]} is restricted")
            rev = api[3] if api else matched[2]
            if rev not in (None, "main", repo.sha):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            if api and api[2] == "tree":
                return self._json([{"type": "file", "path": p, "size": len(d),
                                    "oid": hashlib.sha1(d).hexdigest()}
                                   for p, d in repo.files.items()])
            if api:
                return self._json({"id": matched[1], "sha": repo.sha, "private": False,
                                   "siblings": [{"rfilename": p, "size": len(d),
                                                 "blobId": hashlib.sha1(d).hexdigest()}
                                                for p, d in repo.files.items()]})
            assert resolve is not None
            data = repo.files.get(resolve[3])
            if data is None:
                return self._error(404, "EntryNotFound", f"{resolve[3]} does not exist",
                                   repo.sha)
            self._file(repo, resolve[3], data, body)

        def _file(self, repo: Repo, name: str, data: bytes, body: bool) -> None:
            start = 0
            ranged = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
            if ranged and body:
                start = int(ranged[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in hub.stall_once and not start:
                hub.stall_once.discard(name)
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                hub.release.wait(30)
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def _json(self, value: object) -> None:
            raw = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(raw)

        def _error(self, status: int, code: str, message: str, sha: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if sha:
                self.send_header("X-Repo-Commit", sha)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server


_QWEN3 = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate": "ffn_gate_inp"}


def write_gguf(checkpoint: Path, out: Path, qtype: str, split_tensors: int = 0,
               experts: str | None = None) -> list[Path]:
    """The tiny qwen3_moe `checkpoint` as a GGUF of `qtype` (F16, F32 or Q8_0 for 2-D weights;
    norms stay F32), split into files of `split_tensors` tensors when > 0; returns its files.
    `experts` (a K- or IQ-quant) replaces the routed experts by random blocks of that type
    (gguf-py dequantizes these types but cannot make them)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    weights = load_file(str(checkpoint / "model.safetensors"))
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    writer = gguf.GGUFWriter(str(out), "qwen3moe", split_max_tensors=split_tensors)
    fields = {"block_count": config["num_hidden_layers"],
              "embedding_length": config["hidden_size"],
              "feed_forward_length": config["intermediate_size"],
              "attention.head_count": config["num_attention_heads"],
              "attention.head_count_kv": config["num_key_value_heads"],
              "context_length": config["max_position_embeddings"],
              "expert_count": num_experts,
              "expert_used_count": config["num_experts_per_tok"],
              "expert_feed_forward_length": config["moe_intermediate_size"],
              "rope.dimension_count": config["head_dim"],
              "attention.key_length": config["head_dim"],
              "attention.value_length": config["head_dim"]}
    for key, value in fields.items():
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32("qwen3moe.rope.freq_base", 10000.0)
    _add_tokenizer(writer, json.loads((checkpoint / "tokenizer.json").read_text()), config)
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"],
               "output_norm.weight": weights["model.norm.weight"],
               "output.weight": weights["lm_head.weight"]}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for hf, name in _QWEN3.items():
            tensors[f"blk.{layer}.{name}.weight"] = weights[f"{prefix}{hf}.weight"]
        for proj in ("gate", "up", "down"):
            tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack(
                [weights[f"{prefix}mlp.experts.{e}.{proj}_proj.weight"]
                 for e in range(num_experts)])
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        if experts is not None and "_exps" in name:
            kind = gguf.GGMLQuantizationType[experts]
            writer.add_tensor(name, random_blocks(array.shape, experts), raw_dtype=kind)
        elif array.ndim == 1 or qtype == "F32":
            writer.add_tensor(name, array)
        elif qtype == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.parent.glob(f"{out.stem}*.gguf"))


# Byte offsets of each block's fp16 scale fields (ggml-common.h's block_* structs).
_SCALE_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,), "IQ4_XS": (0,), "IQ4_NL": (0,)}


def random_blocks(shape: tuple[int, ...], qtype: str, std: float = 0.05, seed: int = 0
                  ) -> np.ndarray:
    """Random quant blocks of `qtype` for a float tensor of `shape` (last dim a multiple of the
    block), their fp16 scales set so the dequantized values have about `std`."""
    import gguf
    from gguf.quants import dequantize

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(seed).integers(
        0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)

    def set_scales(scale: float) -> None:
        for offset in _SCALE_FIELDS[qtype]:
            blocks[:, offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)

    set_scales(1e-3)
    set_scales(1e-3 * std / float(dequantize(raw, kind).std()))
    return raw


def _add_tokenizer(writer: object, tokenizer: dict, config: dict) -> None:
    """The byte-level BPE of `tokenizer.json` as `tokenizer.ggml.*` fields (what transformers
    reads back from a GGUF)."""
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    writer.add_tokenizer_pre("qwen2")  # type: ignore[attr-defined]
    writer.add_token_list(tokens)  # type: ignore[attr-defined]
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # type: ignore
    writer.add_token_merges([" ".join(m) for m in tokenizer["model"]["merges"]])  # type: ignore
    writer.add_bos_token_id(config["bos_token_id"])  # type: ignore[attr-defined]
    writer.add_eos_token_id(config["eos_token_id"])  # type: ignore[attr-defined]
    writer.add_pad_token_id(config["pad_token_id"])  # type: ignore[attr-defined]
