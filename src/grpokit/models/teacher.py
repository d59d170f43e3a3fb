"""On-policy distillation's teacher (distill.teacher): a frozen model that scores the tokens the
policy sampled, and the loss turns its log-probs into a per-token advantage (algorithm/loss.py).

- `LocalTeacher`: a model name or folder, in the trainer's process, run through the same log-prob
  passes as the reference model (models/logprobs.py LogProbs.frozen).
- `ServedTeacher`: `distill.teacher=http://host:port`, a `grpokit serve --model <teacher>` whose
  `POST /logprobs` answers the log-probs of given token ids (server.py).

The teacher must read token ids as the policy writes them: its tokenizer's vocabulary is the
policy's, checked at start-up, since a teacher of another vocabulary would score other tokens
than those sampled.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request

import torch

from grpokit.models.loading import check_source, load_model, load_tokenizer, naming
from grpokit.runtime import distributed
from grpokit.runtime.errors import StartupError


def load_teacher(name: str, policy_name: str, policy_tokenizer, dtype: str, device: torch.device,
                 timeout_s: float = 600.0):
    """The teacher `name`: a ServedTeacher for a URL, else a LocalTeacher of that model on `device`."""
    if name.startswith(("http://", "https://")):
        return ServedTeacher(name, policy_name, policy_tokenizer, timeout_s)
    return LocalTeacher(_load(name, policy_name, policy_tokenizer, dtype, device))


def token_records(batch, active: torch.Tensor, old_logps: torch.Tensor, teacher_logps: torch.Tensor) -> list[dict]:
    """Each completion's per-token teacher values as completions.jsonl records them: on the tokens
    the model sampled (tool results left out), in order, the teacher's log-prob and the reverse KL
    estimate the loss uses (student before the update minus teacher). A row with no pass (a failed
    rollout) gets none."""
    mask = batch.trained_mask.bool() & active.view(-1, 1)  # (n, T)
    records = []
    for row_mask, old, teacher in zip(mask, old_logps.tolist(), teacher_logps.tolist()):
        keep = row_mask.tolist()
        records.append({} if not any(keep) else {
            "teacher_logprobs": [round(t, 4) for t, k in zip(teacher, keep) if k],
            "reverse_kl": [round(o - t, 4) for o, t, k in zip(old, teacher, keep) if k]})
    return records


class LocalTeacher:
    """A teacher model in this process."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def logprobs(self, batch, active: torch.Tensor, passes) -> torch.Tensor:
        """Its log-probs (n, T) of the `active` completions of `batch`, by the run's passes."""
        return passes.frozen(self.model, batch, active)


class ServedTeacher:
    """A teacher on a `grpokit serve` (POST /logprobs), tried for `timeout_s` before it counts as down."""

    def __init__(self, url: str, policy_name: str, policy_tokenizer, timeout_s: float):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        health = self._request("/health")
        if health.get("engine") != "transformers" or "vocabulary" not in health:
            raise StartupError(f"distill.teacher={url}: a teacher is served by `grpokit serve --engine transformers` "
                               f"(this server: {health.get('engine')} engine, "
                               f"{'a vocabulary' if 'vocabulary' in health else 'no vocabulary'} in /health, a server "
                               "from before teachers); start it anew with this grpokit")
        if health.get("vocabulary") != vocabulary_digest(policy_tokenizer):
            raise StartupError(f"distill.teacher={url} serves {health.get('model')}, whose vocabulary is not the policy "
                               f"model.name={policy_name}'s: a teacher scores the policy's token ids, so it must share "
                               "its tokenizer")

    def _request(self, path: str, body: dict | None = None) -> dict:
        deadline, delay = time.monotonic() + self.timeout_s, 0.5
        data = None if body is None else json.dumps(body).encode()
        while True:
            request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=self.timeout_s) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                raise RuntimeError(f"the teacher at {self.url} refused {path} (HTTP {e.code}): {e.read()[:500]!r}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"the teacher at {self.url} (distill.teacher) cannot be reached: "
                                       f"{getattr(e, 'reason', e)}; tried for distill.timeout={self.timeout_s:g} s."
                                       " Start it with: grpokit serve --model <teacher> --port <port>") from None
            time.sleep(delay)
            delay = min(2 * delay, 8.0)

    def logprobs(self, batch, active: torch.Tensor, passes) -> torch.Tensor:
        """Its log-probs (n, T) of the `active` completions of `batch` (0 elsewhere), at the passes' temperature."""
        if batch.images is not None or (batch.sequence_ids is not None and bool(batch.sequence_ids.any())):
            raise RuntimeError(f"the teacher at {self.url} scores text rows of one sequence each; this batch has "
                               "images or rows of several sequences: run the teacher in the trainer's process")
        rows = torch.nonzero(active).view(-1).tolist()
        lengths = batch.completion_mask.sum(-1).tolist()
        body = {"prompts": [batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist() for r in rows],
                "completions": [batch.completion_ids[r, :lengths[r]].tolist() for r in rows],
                "temperature": passes.temperature}
        answered = self._request("/logprobs", body)["logprobs"]
        out = torch.zeros(batch.completion_ids.shape, device=passes.device)  # (n, T)
        for r, values in zip(rows, answered):
            out[r, :len(values)] = torch.tensor(values)
        return out


def vocabulary_digest(tokenizer) -> str:
    """What identifies a tokenizer's vocabulary (every token and its id)."""
    vocabulary = getattr(tokenizer, "tokenizer", tokenizer).get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocabulary.items())).encode()).hexdigest()[:32]


def _load(name: str, policy_name: str, policy_tokenizer, dtype: str, device: torch.device):
    """The teacher model `name` on `device`, frozen, in eval mode; refused (StartupError, both
    names) when its vocabulary is not the policy's `policy_name`'s."""
    with naming("distill.teacher"):  # a folder that is missing or cannot be read, named as the teacher's
        check_source(name)
        check_vocabulary(name, load_tokenizer(name), policy_name, policy_tokenizer)
        teacher = load_model(name, dtype).to(device).eval().requires_grad_(False)
    distributed.broadcast_parameters(teacher)
    vocabulary = len(getattr(policy_tokenizer, "tokenizer", policy_tokenizer))
    if teacher.get_output_embeddings().weight.shape[0] < vocabulary:
        raise StartupError(f"distill.teacher={name}: its output layer scores {teacher.get_output_embeddings().weight.shape[0]} "
                           f"tokens, fewer than the {vocabulary} of the policy {policy_name}'s tokenizer")
    return teacher


def check_vocabulary(name: str, tokenizer, policy_name: str, policy_tokenizer) -> None:
    """The same token for every id in both tokenizers, or a StartupError naming both models."""
    theirs = getattr(tokenizer, "tokenizer", tokenizer).get_vocab()
    ours = getattr(policy_tokenizer, "tokenizer", policy_tokenizer).get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise StartupError(f"distill.teacher={name} has another vocabulary than the policy model.name={policy_name} "
                           f"({len(theirs)} tokens against {len(ours)}; e.g. {differ}): a teacher scores the policy's "
                           "token ids, so it must share its tokenizer")
