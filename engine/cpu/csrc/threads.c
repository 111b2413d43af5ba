/* The engine's OpenMP threads, one per CPU (see kvrelay.engine.cpu.thread_pinning). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

/* Thread i of a team of n (the caller is thread 0) onto CPU cpus[i]; each thread's kernel id
 * into tids[i] (left as the caller set it where there was no such thread or its affinity could
 * not be set). libgomp keeps a master's team threads in a pool and gives team slot i the same
 * pooled thread in every later region of up to n threads, so the pinning lasts. Returns how
 * many of the n threads are not pinned. */
int kvr_pin_threads(const int32_t *cpus, int n, int64_t *tids) {
    int pinned = 0;
    #pragma omp parallel num_threads(n) reduction(+:pinned)
    {
        const int t = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[t], &set);
        if (sched_setaffinity(0, sizeof(set), &set) == 0) {
            tids[t] = (int64_t)syscall(SYS_gettid);
            pinned++;
        }
    }
    return n - pinned;
}
