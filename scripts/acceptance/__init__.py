"""scripts/gpu_acceptance.sh's runner: a stage's steps on the GPU, or rehearsed on the CPU, ending
in one PASS/FAIL table. The stages are the modules of scripts/acceptance/stages/."""
