#!/usr/bin/env bash
# The C++ API from the outside, as a user gets it: `cmake --install` dtactor
# into a temporary prefix, build examples/custom_task against the installed
# package (find_package(dtactor)), and use the program it makes: a 2-node
# `local` run of its own task, eval and export of that run, bad input.
# Usage: custom_task_test.sh BUILD_DIR SOURCE_DIR
set -u
build=$1
src=$2
source "$(dirname "$0")/script_checks.sh"

prefix=$work/prefix
if cmake --install "$build" --prefix "$prefix" >"$work/install.log" 2>&1; then
  ok "cmake --install"
else
  bad "cmake --install"; cat "$work/install.log"; finish
fi
for f in include/dtactor/dtactor.hpp include/dtactor/task.hpp lib/cmake/dtactor/dtactorConfig.cmake bin/dtactor; do
  [ -e "$prefix/$f" ] && ok "installed $f" || bad "installed $f is missing"
done
ls "$prefix"/lib*/libdtactor.so >/dev/null 2>&1 && ok "installed libdtactor.so" || bad "libdtactor.so is not installed"
# The installed binary finds the installed library (RPATH $ORIGIN/../lib).
if "$prefix/bin/dtactor" config >/dev/null 2>"$work/err"; then ok "installed dtactor runs"; else bad "installed dtactor runs"; cat "$work/err"; fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if cmake -S "$src/examples/custom_task" -B "$work/example" -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" >"$work/configure.log" 2>&1 &&
   cmake --build "$work/example" >"$work/build.log" 2>&1; then
  ok "examples/custom_task builds against the installed package"
else
  bad "examples/custom_task builds against the installed package"; cat "$work/configure.log" "$work/build.log" | tail -40; finish
fi
bin=$work/example/tabular_trainer

cd "$work"
/usr/bin/python3 "$src/examples/custom_task/make_data.py" data >/dev/null || { bad "make_data.py"; finish; }
cp "$src/examples/custom_task/tabular.toml" .

# Its own keys are part of the config: listed, settable, typo-checked.
"$bin" config --reference >ref.txt 2>&1
grep -q "Registered here: tabular" ref.txt && grep -q "model.hidden = 64" ref.txt && ok "config --reference lists the task and its keys" ||
  bad "config --reference lists the task and its keys"
"$bin" config --config tabular.toml --set model.hiden=8 >/dev/null 2>err.txt
rc=$?
[ $rc -eq 2 ] && grep -q "did you mean 'model.hidden'" err.txt && ok "a typo in the task's key is one clear line" ||
  { bad "a typo in the task's key (rc $rc)"; cat err.txt; }

# A 2-node local run of the task.
"$bin" local --nodes 2 --config tabular.toml --run-dir run --set train.max_steps=60 --set eval.every_steps=30 \
  --set checkpoint.every_steps=30 >local.log 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "finished at step 60: accuracy=" local.log && grep -q "world_size=2" local.log; then
  ok "2-node local run of the registered task"
else
  bad "2-node local run of the registered task (rc $rc)"; tail -20 local.log
fi
acc=$(grep '"event":"eval","step":60,' run/journal.jsonl | grep -o '"accuracy":[0-9.e-]*' | head -1 | cut -d: -f2)
awk -v a="${acc:-0}" 'BEGIN { exit !(a > 0.5) }' && ok "it learns (accuracy $acc after 60 steps)" || bad "accuracy after 60 steps: '${acc}'"
grep -q "train_csv = '$work/data/train.csv'" run/config.toml && ok "file keys are stored absolute" || bad "file keys are stored absolute"

# eval and export of that run.
"$bin" eval run >eval.log 2>&1 && grep -q "step 60 accuracy=" eval.log && ok "eval of the run" || { bad "eval of the run"; cat eval.log; }
"$bin" export run --out model.pt >export.log 2>&1 && grep -q "state_dict of step 60 (6 tensors)" export.log && ok "export of the run" ||
  { bad "export of the run"; cat export.log; }

# Bad input in the task's own files: one line, exit 1.
printf 'x,y,label\n0.1,0.2,0\n0.3,oops,1\n' >bad.csv
"$bin" train --config tabular.toml --set data.train_csv=bad.csv --run-dir badrun >/dev/null 2>err.txt
rc=$?
[ $rc -eq 1 ] && [ "$(wc -l <err.txt)" -eq 1 ] && grep -q "bad.csv' line 3: 'oops' is not a number" err.txt && ok "a bad CSV row is one clear line" ||
  { bad "a bad CSV row (rc $rc)"; cat err.txt; }

# The plain dtactor binary does not know the task: one line, exit 2.
"$prefix/bin/dtactor" config --set model.name=tabular >/dev/null 2>err.txt
rc=$?
[ $rc -eq 2 ] && grep -q "model.name' must be one of vit, transformer, gpt, torchscript, got 'tabular'" err.txt &&
  ok "plain dtactor refuses the unregistered task" || { bad "plain dtactor refuses the unregistered task (rc $rc)"; cat err.txt; }
finish
