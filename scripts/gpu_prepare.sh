#!/bin/bash
# On a CUDA machine prepared as ../shared/gpu/README.md describes (.gpu/ staged by prepare.sh):
# build llama.cpp with CUDA and make the 7b-mha and 8b-gqa random-weight models, the f16 model
# files generated in parallel with the build to fit one 10-minute command.
#   bash scripts/gpu_prepare.sh && . /tmp/lcgpu/env.sh
set -uo pipefail
G=$(pwd)/.gpu; W=/tmp/lcgpu; mkdir -p $W/models
python3 -m pip install -q --no-index --no-deps --target $W/site $G/whl/*.whl || exit 1
[ -d "$(ls -d $W/llama_cpp_python-* 2>/dev/null | head -1)" ] || tar xzf $G/lcp.tar.gz -C $W
S=$(ls -d $W/llama_cpp_python-* | head -1)
export PYTHONPATH=$W/site:$S:$S/vendor/llama.cpp/gguf-py
t0=$(date +%s)
gen() { [ -f $W/models/$1.gguf ] || python3 $G/make_model.py $G/vocab-smollm2.gguf $W/models/$1-f16.gguf $2 $3 $4 $5 $6 > $W/gen-$1.log 2>&1; }
WANT=${MODELS:-"7b-mha 8b-gqa"}
P1=; P2=
case " $WANT " in *" 7b-mha "*) gen 7b-mha 32 4096 32 32 11008 & P1=$! ;; esac
case " $WANT " in *" 8b-gqa "*) gen 8b-gqa 32 4096 32 8 14336 & P2=$! ;; esac
MODELS=tiny bash $G/build.sh > $W/build-all.log 2>&1 || { tail -30 $W/build-all.log; exit 1; }
echo "build done at $(( $(date +%s) - t0 )) s"
wait $P1 $P2
for m in $WANT; do
  [ -f $W/models/$m.gguf ] && continue
  $W/build/bin/llama-quantize $W/models/$m-f16.gguf $W/models/$m.gguf Q4_K_M "$(nproc)" > $W/quant-$m.log 2>&1 \
    && rm -f $W/models/$m-f16.gguf || { tail -5 $W/quant-$m.log; exit 1; }
done
echo "models done at $(( $(date +%s) - t0 )) s"; ls -la $W/models
