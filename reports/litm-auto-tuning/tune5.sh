#!/bin/bash
# issue 5: tune the adaptive target on seed 1 (records, nq) and lockers seed 3
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
M="auto,auto:target=0.1:strength=5,auto:target=0.2:strength=5,auto:target=0.35:strength=5"
kvedit eval litm --task nq --seed 1 --trials 100 --limit 30 --methods none,$M --out runs/tune-nq-seed1 --no-progress
kvedit eval litm --task records --seed 1 --trials 6 --methods $M --out runs/tune-records-seed1 --no-progress
kvedit eval litm --data runs/lockers-seed3.jsonl --methods none,oracle,$M --out runs/tune-lockers-seed3 --no-progress
