"""A rollout engine that replies from a script, for tests of multi-turn rollouts on tiny-random
(whose random weights never write a tool call). Registered by tests as ENGINES["scripted"].

Reply k of SCRIPT answers a context that holds k tool results (k times TURN_MARK, how the chat
template begins one); a reply is text (encoded) or token ids (kept as they are), followed by EOS,
cut to the turn's max_tokens. The trainer computes the
log-probs itself (exact_logprobs), so the script's tokens train like sampled ones."""

from grpokit.engines.batch import from_completions

SCRIPT: list = []
TURN_MARK = "<tool_response>"


class ScriptedEngine:
    exact_logprobs = True
    measures_entropies = True
    remote = False

    @classmethod
    def from_config(cls, rollout, model, tokenizer, eos_ids, model_name, lockstep, vision=None):
        return cls(tokenizer, eos_ids[0])

    def __init__(self, tokenizer, eos_id):
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.calls = []  # every generate call's contexts, for tests to look at

    def generate(self, prompts, n, params, seeds=None, images=None):
        self.calls.append(prompts)
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        completions = []
        for prompt, count in zip(prompts, counts):
            turn = self.tokenizer.decode(prompt).count(TURN_MARK)
            reply = SCRIPT[min(turn, len(SCRIPT) - 1)]
            ids = (self.tokenizer(reply, add_special_tokens=False)["input_ids"] if isinstance(reply, str)
                   else list(reply)) + [self.eos_id]
            finish = "length" if len(ids) > params.max_tokens else "stop"
            ids = ids[: params.max_tokens]
            completions += [{"token_ids": ids, "logprobs": [0.0] * len(ids), "entropies": [1.0] * len(ids),
                             "finish_reason": finish}] * count
        return from_completions(prompts, counts, completions, self.tokenizer.pad_token_id)

    def weights_updated(self):
        pass

    def needs_weights(self):
        return False

    def use_weights(self, weights):
        pass

    def sleep(self):
        pass

    def close(self):
        pass
