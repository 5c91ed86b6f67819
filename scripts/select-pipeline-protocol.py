# Model check of select_scores_wg's synchronisation (kernels/sparse/select_wgmma.cu): its 8
# warps (warpgroup 0: 0-3, 1: 4-7) in random interleavings, cp.async arrivals landing at random
# later times. Checks: no deadlock, every mbarrier arrival belongs to the barrier's current
# phase, no waiter 2+ phases behind, and named barriers never see a second generation's arrival
# before the first completes. Run: python3 scripts/select-pipeline-protocol.py ("failures 0").
import random, sys

def run(A, B, run0, run1, seed):
    rnd = random.Random(seed)
    total = A + B
    class MB:
        def __init__(s, count): s.count, s.left, s.ph = count, count, 0
        def arrive(s, phase, who):
            if phase != s.ph: raise Exception(f"{who}: arrival for phase {phase} at phase {s.ph}")
            s.left -= 1
            if s.left == 0: s.ph += 1; s.left = s.count
        def done(s, phase, who):
            if s.ph >= phase + 2: raise Exception(f"{who}: waiter 2 phases behind")
            return (s.ph & 1) != (phase & 1)
    full = [MB(4), MB(4)]      # 4 warps of WG1 (one arrival per warp stands for 32 threads)
    empty = [MB(8), MB(8)]
    # named barriers: id -> (expected warps, arrived list of (warp, blocking))
    nb = {i: [] for i in (0, 1, 2, 3, 4)}
    nb_need = {0: 8, 1: 4, 2: 4, 3: 8, 4: 8}
    released = set()
    pending = []  # (time, barrier index, phase)
    def prog(w):
        wg = w // 4
        yield ('bar', 0, True)
        if wg == 1:
            yield ('stage', 0); yield ('stage', 1)
            yield ('bar', 3, False)
        yield ('bar', 1 + wg, True)
        runs = run0 if wg == 0 else run1
        for t in range(A):
            yield ('wait', full[t & 1], t >> 1, f'full t{t}')
            for hf in (0, 1):
                yield ('bar', 3 if wg == 0 else 4, True)
                yield ('bar', 4 if wg == 0 else 3, False)
                if hf == 1:
                    yield ('arrive', empty[t & 1], t >> 1)
                    if wg == 1 and t + 2 < total:
                        yield ('wait', empty[t & 1], t >> 1, f'empty t{t}')
                        yield ('stage', t + 2)
        yield ('bar', 1 + wg, True); yield ('bar', 1 + wg, True)
        for t in range(A, total):
            yield ('wait', full[t & 1], t >> 1, f'full t{t}')
            yield ('bar', 3 if wg == 0 else 4, True)
            yield ('bar', 4 if wg == 0 else 3, False)
            yield ('arrive', empty[t & 1], t >> 1)
            if wg == 1 and t + 2 < total:
                yield ('wait', empty[t & 1], t >> 1, f'empty t{t}')
                yield ('stage', t + 2)
            if t - A < runs:
                yield ('bar', 1 + wg, True)
        if wg == 0:
            yield ('bar', 3, True)
    gens = [prog(w) for w in range(8)]
    cur = [next(g) for g in gens]
    blocked = [False] * 8
    done = [False] * 8
    clock = 0
    while not all(done):
        clock += 1
        # land some cp.async arrivals
        for p in list(pending):
            if rnd.random() < 0.3:
                pending.remove(p); full[p[1]].arrive(p[2], 'cp.async')
        ready = []
        for w in range(8):
            if done[w]: continue
            op = cur[w]
            if op[0] == 'wait':
                if op[1].done(op[2], f'w{w} {op[3]}'): ready.append(w)
            elif op[0] == 'bar' and op[2] and blocked[w]:
                if w in released: ready.append(w)
            else: ready.append(w)
        if not ready:
            if pending: continue
            raise Exception(f"deadlock at {[c[:2] if c else None for c in cur]}")
        w = rnd.choice(ready)
        op = cur[w]
        if op[0] == 'bar':
            _, i, blocking = op
            if blocking and blocked[w]:
                released.discard(w); blocked[w] = False
            else:
                if any(x == w for x, _ in nb[i]): raise Exception(f"w{w} arrives twice at barrier {i}")
                nb[i].append((w, blocking))
                if len(nb[i]) == nb_need[i]:
                    for x, b in nb[i]:
                        if b and x != w: released.add(x)
                    nb[i] = []
                elif blocking:
                    blocked[w] = True
                    continue
        elif op[0] == 'stage':
            pass_ = op[1]
            if w >= 4: pending.append((clock, pass_ & 1, pass_ >> 1))
        elif op[0] == 'arrive':
            op[1].arrive(op[2], f'w{w}')
        try: cur[w] = next(gens[w])
        except StopIteration: done[w] = True
    for i in nb:
        if nb[i]: raise Exception(f"barrier {i} left with {nb[i]}")
    return clock

bad = 0
for seed in range(3000):
    r = random.Random(seed)
    A, B = r.randint(1, 6), r.randint(1, 8)
    run0, run1 = r.randint(0, B), r.randint(0, B)
    try: run(A, B, run0, run1, seed)
    except Exception as e:
        bad += 1
        if bad < 5: print('seed', seed, A, B, run0, run1, e)
print('failures', bad)
sys.exit(1 if bad else 0)
