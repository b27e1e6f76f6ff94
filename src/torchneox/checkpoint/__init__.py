"""Floor 4: checkpoints: the manager (save, resume, rotate, verify), the file format, the writer
process and background saves, weights loaded into shards, Hugging Face folders read and written in
training, and S3 uploads."""
