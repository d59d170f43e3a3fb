"""Chat templates written for tests, each in the way a model family renders thinking and tool calls,
over SmolLM2's tokenizer (its <|im_end|> ends every turn, as the model's EOS must): Qwen3's with its
real rule for earlier reasoning, one that drops every earlier turn's reasoning, and Llama 3's,
Mistral's and GPT-OSS's (harmony) tool-call formats. CALLS: a reply each family's model writes
calling add(a=1, b=2), and what it reads as."""

# Qwen3's rule: the turns after the last user question keep their reasoning; the last assistant
# turn is always in a think block (empty without reasoning), an earlier one only with reasoning.
# enable_thinking=false opens and closes an empty think block in the generation prompt.
QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none "
    "else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- for call in m.tool_calls or [] %}{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + "
    "'\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# DeepSeek-R1's rule: no earlier assistant turn keeps its reasoning; only the last one shows it.
STRIPPING = QWEN3.replace("{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}",
                          "{%- if loop.last and reasoning %}")

_TURNS = (  # user and system turns, tool results and the generation prompt, in ChatML; `{calls}` per family
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}{calls}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>tool\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SCHEMAS = ("{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
            "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}")

# Llama 3.1's: a call is {"name": ..., "parameters": {...}} after <|python_tag|>, several joined by "; ".
LLAMA3 = _SCHEMAS + "{{- '' }}{#- Respond with a JSON dictionary of argument name and its value -#}" + _TURNS.replace(
    "{calls}", "{%- if m.tool_calls %}{{- '<|python_tag|>' }}{%- for call in m.tool_calls %}{%- if not loop.first %}"
    "{{- '; ' }}{%- endif %}{{- {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}"
    "{%- endfor %}{%- endif %}")

# Mistral's (v3): [TOOL_CALLS] then a JSON list of the calls.
MISTRAL = _SCHEMAS + _TURNS.replace(
    "{calls}", "{%- if m.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for call in m.tool_calls %}{%- if not loop.first %}"
    "{{- ', ' }}{%- endif %}{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "{%- endfor %}{{- ']' }}{%- endif %}")

# GPT-OSS's harmony: the reasoning in the analysis channel, a call in the commentary channel to
# functions.<name>, the answer in the final channel.
HARMONY = _SCHEMAS + (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|im_end|>' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.reasoning_content is defined and m.reasoning_content %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.function.name"
    " + ' <|constrain|>json<|message|>' + (call.function.arguments | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- if not m.tool_calls %}{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') }}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary"
    "<|message|>' + m.content + '<|im_end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}
# family -> (its template, a reply of its model's calling add(a=1, b=2), the reply's content, what
# begins a tool result in its template)
CALLS = {
    "hermes": (QWEN3, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "",
               "<tool_response>"),
    "llama3": (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", "<|im_start|>tool"),
    "mistral": (MISTRAL, 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Adding.",
                "<|im_start|>tool"),
    "harmony": (HARMONY, '<|channel|>analysis<|message|>I add them.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>', "", "<|start|>functions."),
}
