"""The batchgate GPU worker: intake from lane streams, a pure scheduler, model runners, result publisher."""
