#!/usr/bin/env bash
# schedule_cli.sh - `fp8moe schedule` end to end (issue 20): the documented lines (docs/parallelism.md,
# "Pipeline schedules") for each kind - the header, the validation line, the compact ops with and
# without messages, `bubble formula=X simulated=Y` with Table 2's numbers (1F1B 45 at pp=16, DualPipe
# 2(PP/2-1)), every rank's busy time, bubble, activation and parameter memory, the timeline - and every
# bad argument refused with exit status 2 and a message naming it.
# Uses $FP8MOE_BUILD/fp8moe (default build/). Run from the repository root. Takes well under a second.
set -u
. tests/lib.sh
test_begin schedule_cli.sh

S="$BIN schedule"
# ---- the documented lines
run dp 0 $S --kind dualpipe --pp 8 --microbatches 20 --print-ops --costs F=1,B=2,W=1,FB=3 \
  && has dp out '^schedule dualpipe pp=8 microbatches=20 pipes=2 stages=8 chunks=2$' \
  && has dp out '^valid: every static check passed \([0-9]+ ops, [0-9]+ messages\)$' \
  && has dp out '^memory: a stage is 1/8 of the model' \
  && has dp out '^rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 1F0 1I0 W 1F1 ' && has dp out ' \(0F7;1B3\) ' \
  && lacks dp out 's0F0>1' \
  && has dp out '^costs F=1 B=2 W=1 I=1 FB=3 sends=eager$' && has dp out '^makespan=66$' \
  && has dp out '^bubble formula=6 simulated=6$' \
  && [ "$(grep -c '^rank [0-7]: busy=60 bubble=6 activations=9 parameters=2x$' "$TMP/dp.out")" = 8 ] \
  && pass "dualpipe pp=8: ops, bubble 2(PP/2-1) = 6 on every rank, activations PP+1, parameters 2x"
run f1b 0 $S --kind 1f1b --pp 16 --microbatches 32 --costs F=1,B=2 \
  && has f1b out '^bubble formula=45 simulated=45$' && has f1b out '^rank 0: busy=96 bubble=45 activations=16 parameters=1x$' \
  && has f1b out '^rank 15: busy=96 bubble=45 activations=1 parameters=1x$' && pass "1f1b pp=16: bubble 45"
run zb 0 $S --kind zb1p --pp 4 --microbatches 8 --costs F=1,B=2,W=0.5 --print-ops \
  && has zb out '^bubble formula=6 simulated=6$' && has zb out '^rank 3: 0F0 0I0 0F1 0I1 0F2 0I2 0F3 0I3 W ' \
  && has zb out '^rank 1: busy=24 bubble=6 activations=4 parameters=1x$' && pass "zb1p pp=4: bubble (PP-1)(F+B-2W)"
run zbw 0 $S --kind zb1p --pp 4 --microbatches 8 --costs F=1,B=2,W=1 --wait-sends \
  && has zbw out 'sends=wait' && lacks zbw out 'simulated=3$' && pass "--wait-sends changes the simulation"
run dpv 0 $S --kind dualpipev --pp 4 --microbatches 8 --print-ops=all \
  && has dpv out '^schedule dualpipev pp=4 microbatches=8 pipes=1 stages=8 chunks=2$' \
  && has dpv out '^rank 0: 0F0 \[s0F0>1\] ' && has dpv out 'r1F0<1' \
  && has dpv out '^rank 3: activations=9 parameters=2x$' && lacks dpv out 'bubble' \
  && pass "dualpipev: messages with =all, memory without --costs"
run tl 0 $S --kind 1f1b --pp 2 --microbatches 2 --timeline --costs F=1,B=2 \
  && has tl out '^rank 0 \|0F0 0F1 \.\.\.\.\.\.\.\.0B0     \.\.\.\.0B1     \|$' && pass "timeline"
run few 0 $S --kind 1f1b --pp 4 --microbatches 2 --costs F=1,B=2 \
  && has few out 'formula assumes microbatches >= pp' && pass "1f1b with fewer micro-batches than ranks"
run help 0 $S --help && has help out 'fp8moe schedule --kind 1f1b\|zb1p\|dualpipe\|dualpipev' && pass "schedule --help"
run mainhelp 0 "$BIN" --help && has mainhelp out 'fp8moe schedule --kind' && pass "fp8moe --help lists schedule"

# ---- refused arguments: exit 2, the argument named
refuse() {  # refuse NAME PATTERN ARGS...
  local name=$1 pat=$2; shift 2
  run "$name" 2 $S "$@" && has "$name" err "$pat" && pass "refused: $*"
}
refuse nokind 'missing --kind' --pp 4 --microbatches 8
refuse nopp 'missing --pp' --kind 1f1b --microbatches 8
refuse nomb 'missing --microbatches' --kind 1f1b --pp 4
refuse badkind '--kind gpipe: expected 1f1b, zb1p, dualpipe or dualpipev' --kind gpipe --pp 4 --microbatches 8
refuse pp0 '--pp 0: expected an integer from 1 to 128' --kind 1f1b --pp 0 --microbatches 8
refuse ppx '--pp x: expected an integer' --kind 1f1b --pp x --microbatches 8
refuse mbneg '--microbatches -1: expected an integer from 1' --kind 1f1b --pp 4 --microbatches -1
refuse odd 'dualpipe: pp = 3 is odd' --kind dualpipe --pp 3 --microbatches 12
refuse fewmb 'microbatches = 6 < 2 x pp = 2 x 4 = 8' --kind dualpipe --pp 4 --microbatches 6
refuse vfew 'dualpipev: microbatches = 5 < 2 x pp = 2 x 3 = 6' --kind dualpipev --pp 3 --microbatches 5
refuse badkey "unknown key 'Q'" --kind 1f1b --pp 2 --microbatches 4 --costs F=1,Q=2
refuse wbig 'W=3 > B=2' --kind zb1p --pp 2 --microbatches 4 --costs W=3
refuse badval 'F=fast - expected a number >= 0' --kind zb1p --pp 2 --microbatches 4 --costs F=fast
refuse unknown 'unknown option --frob' --kind 1f1b --pp 2 --microbatches 4 --frob
refuse printx '--print-ops=x: expected --print-ops or --print-ops=all' --kind 1f1b --pp 2 --microbatches 4 --print-ops=x
refuse tlx '--timeline=0: expected --timeline=COLS' --kind 1f1b --pp 2 --microbatches 4 --timeline=0
refuse waitonly '--wait-sends needs --costs or --timeline' --kind 1f1b --pp 2 --microbatches 4 --wait-sends
refuse novalue '--pp needs a number' --kind 1f1b --microbatches 4 --pp
refuse stray 'unexpected argument 4' --kind 1f1b --pp 2 4

test_end
