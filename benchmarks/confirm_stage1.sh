#!/usr/bin/env bash
# Stage 1 of the pre-registered ESamp experiment (docs/history.md, "Confirmatory
# experiment"): the plan's three commands as written, with SEL from stage 0's rule. Each
# command resumes from its --partial file, so a run cut short is continued by running this
# again; commit benchmarks/results/confirm_*_samples.json.gz in between.
#   bash benchmarks/confirm_stage1.sh        # from the repository root, on an idle machine
set -euo pipefail
cd "$(dirname "$0")/.."
SEL=$(python benchmarks/stage0_select.py benchmarks/results/confirm_stage0.json | sed -n 's/^SEL=//p')
[ -n "$SEL" ] || { echo "confirm_stage1.sh: stage 0's rule gave no SEL" >&2; exit 2; }
SHARP='sharp={"init": "zero_output", "train": false}'
echo "stage 1 with SEL=$SEL" >&2
python benchmarks/passk.py --problems 128 --families multi_worked --task-seed 2029 -n 16 \
  --max-tokens 192 --seed 9000 --beta 0.25 --controls temperature,noise,fnoise --variant-noise \
  --esamp-variant "sel=$SEL" --esamp-variant "$SHARP" --ks 1,2,4,8,16 --enforce-eager \
  --methods esamp_sel_b0.25,frozen_sel_b0.25,fnoise_sel_b0.25,noise_sel_b0.25,esamp_sharp_b0.25,temp_0.8 \
  --partial benchmarks/results/confirm_passk_samples.json.gz \
  --json > benchmarks/results/confirm_passk.json.tmp
mv benchmarks/results/confirm_passk.json.tmp benchmarks/results/confirm_passk.json
python benchmarks/diversity.py --prompts benchmarks/prompts_confirm.txt -n 16 --max-tokens 96 \
  --seed 9000 --beta 0.25 --fnoise --variant-noise --esamp-variant "sel=$SEL" \
  --esamp-variant "$SHARP" --enforce-eager --vanilla-temps 0.6,0.7,0.8,0.9,1.1,1.2 \
  --methods esamp_sel_b0.25,frozen_sel_b0.25,fnoise_sel_b0.25,noise_sel_b0.25,esamp_sharp_b0.25,vanilla_t0.6,vanilla_t0.7,vanilla_t0.8,vanilla_t0.9,vanilla_t1.1,vanilla_t1.2 \
  --partial benchmarks/results/confirm_diversity_samples.json.gz \
  --json > benchmarks/results/confirm_diversity.json.tmp
mv benchmarks/results/confirm_diversity.json.tmp benchmarks/results/confirm_diversity.json
python benchmarks/confirm.py --passk benchmarks/results/confirm_passk.json \
  --diversity benchmarks/results/confirm_diversity.json --esamp esamp_sel_b0.25 \
  --ablations frozen_sel_b0.25,fnoise_sel_b0.25,noise_sel_b0.25,esamp_sharp_b0.25 \
  --frozen frozen_sel_b0.25 --json > benchmarks/results/confirm_verdict.json.tmp
mv benchmarks/results/confirm_verdict.json.tmp benchmarks/results/confirm_verdict.json
python benchmarks/confirm.py --passk benchmarks/results/confirm_passk.json \
  --diversity benchmarks/results/confirm_diversity.json --esamp esamp_sel_b0.25 \
  --ablations frozen_sel_b0.25,fnoise_sel_b0.25,noise_sel_b0.25,esamp_sharp_b0.25 \
  --frozen frozen_sel_b0.25 --markdown
