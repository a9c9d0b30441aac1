"""CPU seconds per training step of the default translation model on the bundled corpus.

Run from the repository root: PYTHONPATH=src python3 benchmarks/translation_step_cost.py
Prints one JSON line (tokenizer+encoding CPU time, CPU s per step, target tokens per CPU s).
"""
import time, json, torch, tempfile
torch.set_num_threads(2)
from aiayn.config import TransformerConfig
from aiayn.tasks.translation import TranslationTask
t0 = time.process_time()
task = TranslationTask(["data/ddtp_en_de.tsv.gz"], vocab_size=6000, max_tokens=2500, valid_bleu_sentences=0)
prep = time.process_time() - t0
cfg = task.model_config(TransformerConfig.preset("mt-cpu"))
torch.manual_seed(0)
model = task.build_model(cfg)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
batches = task.train_batches(0)
tokens, cpu = 0, 0.0
for i in range(8):
    b = next(batches)
    c0 = time.process_time()
    loss = task.loss(model, b) / task.count(b); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()
    if i >= 2:
        cpu += time.process_time() - c0; tokens += task.count(b)
print(json.dumps({"prep_cpu_s": round(prep, 1), "train_pairs": len(task.train_source), "cpu_s_per_step": round(cpu / 6, 3), "target_tokens_per_step": tokens / 6, "target_tokens_per_cpu_s": round(tokens / cpu, 1)}))
