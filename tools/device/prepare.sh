#!/usr/bin/env bash
# Here (the CPU machine), from the repository root: the payload of the two device calls that install CuTe DSL and the
# jsonschema wheels on a fresh GPU machine and bring the embedded model's weights, inside the 64 MiB a call carries.
#
#   bash tools/device/prepare.sh            # -> .devwheels/c1 (~55 MB), .devwheels/c2 (~47 MB), .devwheels/fp8 (~5 MB);
#                                           #    .devdata/ (wikitext-2)
#
# The CUDA-13 library wheel of nvidia-cutlass-dsl is ~92 MB zipped; unpacked and xz-compressed it is ~64 MB, split
# across the two calls. The tracked weights (45 MB) travel xz-compressed (32 MB) in call 2, with the tracked file
# moved aside for both calls (tools/device/README.md says the sequence). Never commit .devwheels or .devdata.
set -euo pipefail
VER=${CUTEDSL_VERSION:-4.8.1}
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.devwheels/ /.devdata/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
mkdir -p .devwheels/dl .devwheels/js
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .devwheels/dl \
  "nvidia-cutlass-dsl==$VER" "nvidia-cutlass-dsl-libs-base==$VER" "nvidia-cutlass-dsl-libs-core==$VER" "nvidia-cutlass-dsl-libs-cu13==$VER"
# jsonschema (mla-eval validates every result document) and what it needs beyond the GPU image
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .devwheels/js \
  "jsonschema==4.26.0" jsonschema-specifications referencing rpds-py
# DeepGEMM's FP8 GEMMs (sgl-deep-gemm: a prebuilt CUDA-13 wheel, ~5 MB, no dependencies): its own carry folder,
# .devwheels/fp8, carried by any call that computes FP8 weight math (steps fp8, moe; tests)
mkdir -p .devwheels/fp8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .devwheels/fp8 \
  "sgl-deep-gemm==0.2.5"
rm -rf .devwheels/c1 .devwheels/c2 && mkdir -p .devwheels/c1 .devwheels/c2
big=$(ls .devwheels/dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
if [ ! -f .devwheels/cu13.tar.xz ] || [ "$big" -nt .devwheels/cu13.tar.xz ]; then
  tmp=$(mktemp -d); (cd "$tmp" && unzip -q "$root/$big" && tar cf - . | xz -9 -T2 > "$root/.devwheels/cu13.tar.xz"); rm -rf "$tmp"
fi
split -b 53000000 -d -a 1 .devwheels/cu13.tar.xz .devwheels/cu13.part
mv .devwheels/cu13.part0 .devwheels/c1/cu13.part0
mv .devwheels/cu13.part1 .devwheels/c2/cu13.part1
for w in .devwheels/dl/*.whl; do [[ $w == "$big" ]] || cp "$w" .devwheels/c2/; done
cp .devwheels/js/*.whl .devwheels/c2/
model=mla_eval/default_model/model.safetensors
[ -f "$model" ] || { echo "$model is missing (moved aside?): put it back first" >&2; exit 1; }
sum=$(sha256sum "$model" | cut -d' ' -f1)
if [ ! -f .devwheels/model.safetensors.xz ] || [ "$(cat .devwheels/model.sha256 2>/dev/null)" != "$sum" ]; then
  xz -9 -T2 -c "$model" > .devwheels/model.safetensors.xz && echo "$sum" > .devwheels/model.sha256
fi
cp .devwheels/model.safetensors.xz .devwheels/model.sha256 .devwheels/c2/
mkdir -p .devdata && cp ../shared/data/wikitext-2/wiki.test.raw .devdata/
du -sh .devwheels/c1 .devwheels/c2 .devwheels/fp8 .devdata
echo "ready: tools/device/README.md gives the two calls"
